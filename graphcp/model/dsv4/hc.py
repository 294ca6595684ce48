"""Manifold-constrained hyper-connections (mHC): the residual is ``hc_mult`` streams.

Per token (so on each rank's own rows, no collective): the streams, flattened and
RMS-normalised, are projected to ``pre`` (collapses the streams into the block's input),
``post`` (expands the block's output back) and ``comb`` (mixes the streams,
Sinkhorn-normalised towards a doubly-stochastic matrix), all in float32 as transformers
computes them (``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphcp.model.dsv4.norms import unweighted_rms


class HyperConnection(nn.Module):
    def __init__(self, hidden: int, n: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + n) * n
        self.fn = nn.Parameter(torch.empty(width, n * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [rows, n, hidden]`` -> ``post [rows, n]``, ``comb [rows, n, n]`` (float32)
        and the collapsed block input ``[rows, hidden]`` (the streams' dtype)."""
        n, eps = self.n, self.hc_eps
        flat = unweighted_rms(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(*comb_w.shape[:-1], n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def mix(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block: ``post`` expands its output, ``comb`` (transposed)
    mixes the streams it read, in the streams' dtype."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                 streams)


class HyperHead(nn.Module):
    """The final collapse of the streams into one row before the model's norm."""

    def __init__(self, hidden: int, n: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden, dtype=torch.float32), requires_grad=False)
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
