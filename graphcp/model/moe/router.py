"""Routers: score each token against every expert and pick its top-k experts.

A router maps rows ``x [n, hidden]`` to ``(ids, weights)``: int64 ``[n, k]`` expert
indices, ascending in each row, and their ``[n, k]`` weights (float32, or the dtype the
family's reference casts them to). Everything after the router sums a token's k
expert outputs in slot order, so in ascending expert order: the order transformers
adds them in, whichever rank computed them. Everything after the router (sorting by
expert, the exchange, the weighted sum) only reads these two tensors, so each
family's routing is one subclass, picked by ``MoeConfig.scoring`` in
:func:`make_router`: softmax top-k (Qwen3-MoE, Mixtral) or DeepSeek's grouped sigmoid
(DeepSeek V3.2, GLM-5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphcp.model.moe_config import MoeConfig


class Router(nn.Module):
    """The interface: ``forward(x) -> (ids, weights)`` (see the module doc)."""

    num_experts: int
    top_k: int

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class SoftmaxTopKRouter(Router):
    """Qwen3-MoE and Mixtral, as transformers computes them: logits in the model's dtype
    (``F.linear``), softmax over all experts in float32, top-k, optionally renormalised
    to sum to 1 (float32), then the weights in ``weight_dtype``: Qwen3-MoE casts them to
    the model's dtype, Mixtral keeps float32. Routing is discontinuous (a near-tie
    flips an expert), so the rounding of every step is kept as the reference has it."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, norm_topk_prob: bool, dtype: torch.dtype,
                 weight_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.weight_dtype = weight_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ascending(ids, weights.to(self.weight_dtype))


def ascending(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (expert, weight) slots in ascending expert order."""
    ids, perm = torch.sort(ids, dim=-1)
    return ids, torch.gather(weights, -1, perm)


class GroupedSigmoidRouter(Router):
    """DeepSeek's router (transformers' ``DeepseekV32TopkRouter``), all in float32 (the
    weight and ``e_score_correction_bias`` are float32 whatever the model's dtype, as
    transformers keeps them): sigmoid scores of the logits; the choice adds the
    correction bias (for selection only), keeps the ``topk_group`` best of ``n_group``
    expert groups (a group scores by its best two experts) and takes the top-k experts
    there; the weights are the chosen experts' unbiased scores, renormalised when
    ``norm_topk_prob``, times ``routed_scaling_factor``."""

    def __init__(self, moe: MoeConfig, hidden: int) -> None:
        super().__init__()
        self.moe, self.num_experts, self.top_k = moe, moe.num_experts, moe.top_k
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, n = self.moe, x.shape[0]
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = m.num_experts // m.n_group
        group_scores = choice.view(n, m.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=m.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        keep = keep.unsqueeze(-1).expand(n, m.n_group, per_group).reshape(n, m.num_experts)
        ids = torch.topk(choice.masked_fill(~keep, float("-inf")), k=m.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ascending(ids, weights * m.routed_scaling_factor)


def make_router(moe: MoeConfig, hidden: int, dtype: torch.dtype) -> Router:
    if moe.scoring == "softmax":
        weight_dtype = dtype if moe.weights_in_model_dtype else torch.float32
        return SoftmaxTopKRouter(moe.num_experts, moe.top_k, hidden, moe.norm_topk_prob, dtype, weight_dtype)
    if moe.scoring == "sigmoid":
        return GroupedSigmoidRouter(moe, hidden)
    raise ValueError(f"no router for scoring {moe.scoring!r}")  # MoeConfig refuses other values first
