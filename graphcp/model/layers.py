"""Building blocks of the decoder: RMSNorm, rotary embedding, and the CP = TP MLP.

The MLP is tensor-parallel over the stage's T ranks (the CP group when attention TP
is 1): gate/up are column-parallel (each rank holds ``intermediate / T`` rows of each),
down is row-parallel. The layer communicator (``communicator.py``) brings every row of
the batch to every rank, each multiplies them by its weight shard, and the partial
sums go back to the rank's own rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphcp.model.communicator import LayerCommunicator
from graphcp.model.rope import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # same order of operations as transformers: normalise in float32, cast, then scale
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for every position, float32, indexed by the positions buffer."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv = rope.inv_freq(head_dim)
        freqs = torch.arange(max_positions, dtype=torch.int64).float().unsqueeze(1) * inv.unsqueeze(0)
        emb = torch.cat([freqs, freqs], dim=-1)
        # YaRN's attention factor scales cos and sin (as transformers does); 1.0 otherwise
        self.register_buffer("cos", emb.cos() * rope.attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * rope.attention_factor, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q [n, Hq, D], k [n, Hk, D]; rotate-half convention (as HF)."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    half = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(gate) * up``; with ``limit`` (DeepSeek V4's swiglu_limit) gate clamped to
    <= limit and up to [-limit, limit] first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class ParallelMLP(nn.Module):
    """SwiGLU MLP with gate/up fused and sharded over ``tp_size`` ranks."""

    def __init__(self, hidden: int, intermediate: int, tp_size: int, bias: bool, dtype: torch.dtype,
                 limit: float | None = None) -> None:
        super().__init__()
        self.shard = intermediate // tp_size
        self.limit = limit  # DeepSeek V4's swiglu_limit (graphcp.model.moe.experts.swiglu)
        self.gate_up = nn.Linear(hidden, 2 * self.shard, bias=bias, dtype=dtype)
        self.down = nn.Linear(self.shard, hidden, bias=False, dtype=dtype)
        # row-parallel bias is added once, after the reduce-scatter
        self.down_bias = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False) if bias else None
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor, group) -> torch.Tensor:
        """x: this rank's rows [n, hidden] -> [n, hidden]; ``group``: the layer
        communicator, or a CP group (CP = TP)."""
        comm = LayerCommunicator.of(group)
        out = comm.leave_ffn(self.partial(comm.enter_ffn(x)))
        return out + self.down_bias if self.down_bias is not None else out

    def partial(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum (no bias) of every row: all-gathered rows in, the
        reduce-scatter's input out (a caller may add other partials before it)."""
        gate, up = self.gate_up(rows).split(self.shard, dim=-1)
        return self.down(swiglu(gate, up, self.limit))
