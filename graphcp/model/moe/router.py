"""Routers: score each token against every expert and pick its top-k experts.

A router maps rows ``x [n, hidden]`` to ``(ids, weights)``: int64 ``[n, k]`` expert
indices, ascending in each row, and their ``[n, k]`` weights (float32, or the dtype the
family's reference casts them to). Everything after the router sums a token's k
expert outputs in slot order, so in ascending expert order: the order transformers
adds them in, whichever rank computed them. Everything after the router (sorting by expert, the exchange, the weighted sum) only reads these two
tensors, so routers of other families (sigmoid scores with a correction bias,
group-limited top-k, a routed scaling factor) are new subclasses picked by
``MoeConfig.scoring`` in :func:`make_router`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphcp.moe_config import MoeConfig


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


def make_router(moe: MoeConfig, hidden: int, dtype: torch.dtype) -> Router:
    if moe.scoring == "softmax":
        weight_dtype = dtype if moe.weights_in_model_dtype else torch.float32
        return SoftmaxTopKRouter(moe.num_experts, moe.top_k, hidden, moe.norm_topk_prob, dtype, weight_dtype)
    raise ValueError(f"no router for scoring {moe.scoring!r}")  # MoeConfig refuses other values first
