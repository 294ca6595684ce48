"""V4's norms, in transformers' order of operations: the weighted RMSNorm keeps its
weight in float32 and multiplies before the one cast (``DeepseekV4RMSNorm``); the
unweighted one (per query head, and mHC's input) multiplies in the input's dtype."""

from __future__ import annotations

import torch
from torch import nn

from graphcp.model.dsv4.sparse import rms_weighted


class V4RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_weighted(x, self.weight, self.eps)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
