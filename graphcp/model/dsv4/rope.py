"""RoPE as DeepSeek V4 applies it: interleaved pairs on the *trailing* ``rope_dim``
channels of a head (the leading ones pass through), with two tables: ``main``
(sliding layers) and ``compress`` (compressed layers, their compressors and indexer;
YaRN when the config asks). As transformers: cos and sin in float32, cast to the
activations' dtype, the rotation computed in float32 and cast back. The attention
output's rope slice is rotated back by the conjugate (``-sin``) at the query's position.
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.model.dsv4.cache import SLIDING
from graphcp.model.dsv4.config import DsV4Config
from graphcp.model.dsv4.sparse import rope_tail
from graphcp.model.rope import RopeConfig

MAIN, COMPRESS = "main", "compress"


def _table(rope: RopeConfig, rope_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = rope.inv_freq(rope_dim)
    freqs = torch.arange(max_positions, dtype=torch.int64).float().unsqueeze(1) * inv.unsqueeze(0)
    return freqs.cos() * rope.attention_factor, freqs.sin() * rope.attention_factor


class V4Rotary(nn.Module):
    """cos/sin of every position for both RoPEs: float32 ``[positions, rope_dim / 2]``."""

    def __init__(self, cfg: DsV4Config, max_positions: int) -> None:
        super().__init__()
        for kind, rope in ((MAIN, cfg.main_rope), (COMPRESS, cfg.compress_rope)):
            cos, sin = _table(rope, cfg.rope_dim, max_positions)
            self.register_buffer(f"{kind}_cos", cos, persistent=False)
            self.register_buffer(f"{kind}_sin", sin, persistent=False)

    def table(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"{kind}_cos"), getattr(self, f"{kind}_sin")

    @staticmethod
    def kind_of(layer_kind: str) -> str:
        """Sliding layers rotate with the main RoPE, compressed ones with the compress RoPE."""
        return MAIN if layer_kind == SLIDING else COMPRESS

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, kind: str, inverse: bool = False) -> torch.Tensor:
        """``x [n, ..., D]`` rows at ``positions [n]``; ``inverse``: the conjugate rotation."""
        cos = getattr(self, f"{kind}_cos").index_select(0, positions).to(x.dtype)
        sin = getattr(self, f"{kind}_sin").index_select(0, positions).to(x.dtype)
        if inverse:
            sin = -sin
        for _ in range(x.dim() - 2):  # broadcast over the head dims
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return rope_tail(x, cos, sin)
