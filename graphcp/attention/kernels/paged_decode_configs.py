"""Tile and warp settings of the Triton paged-decode kernel, per head_dim and dtype.

A decode tile is the GQA group's query heads (at least 16 lanes) x ``block_n`` keys, far
smaller than a prefill tile, so the settings favour keys per step. Checked spill-free
at head_dim 64 and 128, GQA groups 4 and 8, one split and eight, with and without LSE,
by ``python -m graphcp.attention.kernels.paged_decode_compile_check`` (ptxas on sm_90a
and sm_100a, no GPU needed): bfloat16 at head_dim 128 spills with 4 warps over 64 keys
(255 registers), not with 8 (191). Not timed on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeTile:
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int


#: (float32 operands, head_dim bound) -> settings; the first row whose bound holds
_TABLE: dict[bool, tuple[tuple[int, DecodeTile], ...]] = {
    False: ((64, DecodeTile(64, 4, 2)), (1 << 30, DecodeTile(64, 8, 2))),
    True: ((64, DecodeTile(32, 4, 2)), (1 << 30, DecodeTile(16, 4, 1))),
}


def decode_tile(head_dim: int, dtype: torch.dtype) -> DecodeTile:
    """The settings for ``head_dim`` and the operands' ``dtype``."""
    for bound, tile in _TABLE[dtype == torch.float32]:
        if head_dim <= bound:
            return tile
    raise AssertionError("the last bound holds every head_dim")  # pragma: no cover
