"""Routers: score each token against every expert and pick its top-k experts.

A router maps rows ``x [n, hidden]`` to ``(ids, weights)``: int64 ``[n, k]`` expert
indices and float32 ``[n, k]`` weights, slot 0 the highest score. Everything after the
router (sorting by expert, the exchange, the weighted sum) only reads these two
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
    """Qwen3-MoE and Mixtral: logits in the model's dtype (as transformers' ``F.linear``),
    softmax over all experts in float32, top-k, optionally renormalised to sum to 1.
    The weights stay float32 (transformers casts Qwen3-MoE's back to the model dtype
    before the weighted sum; keeping them is the more exact of the two)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, norm_topk_prob: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights


def make_router(moe: MoeConfig, hidden: int, dtype: torch.dtype) -> Router:
    if moe.scoring == "softmax":
        return SoftmaxTopKRouter(moe.num_experts, moe.top_k, hidden, moe.norm_topk_prob, dtype)
    raise ValueError(f"no router for scoring {moe.scoring!r}")  # MoeConfig refuses other values first
