"""Tile and warp settings of the Triton sparse latent-attention kernel
(:mod:`graphcp.attention.kernels.sparse_latent`), per latent width and dtype: the one home.

A program holds ``BLOCK_H`` heads of one query row: its float32 accumulator is
``BLOCK_H x kv_lora`` (padded to a power of two) and each gathered tile ``BLOCK_N x
(kv_lora + rope)``, so the latent width, not the head count, sets what fits in
registers. Registers and spills as ptxas reports them for these settings
(``python -m graphcp.attention.kernels.sparse_latent_compile_check``; Triton 3.9; no GPU needed,
and none has run or timed them):

=========  ============  ====================  ================  ================
dtype      kv_lora:rope  block_h/n/warps/stg   sm_90a            sm_100a
=========  ============  ====================  ================  ================
bf16/fp16  512:64        32 / 32 / 8 / 1       214 regs, 0 B     214 regs, 0 B
bf16/fp16  32:8 (tests)  16 / 64 / 4 / 2       128 regs, 0 B     128 regs, 0 B
fp32       512:64        32 / 16 / 8 / 1       188 regs, 0 B     170 regs, 0 B
fp32       32:8 (tests)  16 / 32 / 4 / 1       55 regs, 0 B      56 regs, 0 B
=========  ============  ====================  ================  ================

("0 B": no spill stores or loads; every row and head offset an int64 product.) Triton
3.6 (the GPU image's) is tighter at 512:64 and still spills nothing: bf16 253 / 254
registers (sm_90a / sm_100a), fp32 254 / 225; 32:8: 64 / 64 and 40 / 40. At 512:64 a
bfloat16 program of 64 heads (the flash kernels' tile) spills 1.1-1.4 KB a thread at 8 warps,
and 32 heads with 64-token tiles 0.4 KB, so 32 heads x 32 tokens it is: each gathered
tile is read by 32 heads, DeepSeek V3.2's 128 heads read it four times (from L2 after
the first). A spill-free choice is the precondition for speed, not proof of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SparseTileConfig:
    block_h: int  # heads of one query row per program (>= 16: tl.dot tiles)
    block_n: int  # selected tokens gathered per inner step
    num_warps: int
    num_stages: int


#: (wide dtype, padded latent width bound) -> config; the first row whose bound holds it
_TABLE: dict[bool, tuple[tuple[int, SparseTileConfig], ...]] = {
    False: (  # 16-bit operands: tensor-core products
        (128, SparseTileConfig(16, 64, 4, 2)),
        (1 << 30, SparseTileConfig(32, 32, 8, 1)),
    ),
    True: (  # float32 operands: IEEE products on FMA units
        (128, SparseTileConfig(16, 32, 4, 1)),
        (1 << 30, SparseTileConfig(32, 16, 8, 1)),
    ),
}


def sparse_tile_config(kv_lora_rank: int, dtype: torch.dtype) -> SparseTileConfig:
    """Settings for a latent of ``kv_lora_rank`` values and the operands' ``dtype``."""
    for bound, cfg in _TABLE[dtype == torch.float32]:
        if kv_lora_rank <= bound:
            return cfg
    raise AssertionError("the last bound holds every width")
