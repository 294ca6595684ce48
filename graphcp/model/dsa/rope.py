"""RoPE as the DSA models apply it, on the rope part of a head only.

MLA's query and shared key rotate their ``qk_rope_head_dim`` dims in interleaved
pairs ``(x0, x1), (x2, x3), ...``, each pair by one frequency (DeepSeek's layout); the
indexer rotates the first ``qk_rope_head_dim`` dims of its query and key half-split
(DeepSeek V3.2: ``x_i`` with ``x_{i + d/2}``) or interleaved (GLM-5). The rotated
pairs stay in place (transformers writes the pairs' first members, then the second
ones: a permutation of the same values, so every dot product is the same).

As transformers: cos and sin in float32 (times YaRN's attention factor), cast to the
activations' dtype, the rotation computed in that dtype, op by op.
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.model.rope import RopeConfig


class DsaRotary(nn.Module):
    """cos/sin of every position for ``rope_dim`` rotated dims: float32 ``[positions, rope_dim / 2]``."""

    def __init__(self, rope_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv = rope.inv_freq(rope_dim)
        freqs = torch.arange(max_positions, dtype=torch.int64).float().unsqueeze(1) * inv.unsqueeze(0)
        self.register_buffer("cos", freqs.cos() * rope.attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * rope.attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, rope_dim / 2]`` cos and sin of ``positions``, in ``dtype``."""
        return self.cos.index_select(0, positions).to(dtype), self.sin.index_select(0, positions).to(dtype)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs ``(x[2i], x[2i + 1])`` of the last dim in place (cos/sin broadcast to ``x[..., ::2]``)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[i]`` with ``x[i + d / 2]`` (the rotate-half convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
