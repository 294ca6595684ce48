"""Tile and warp settings of the Triton paged-prefill kernel, per head_dim and dtype.

Chosen so the compiled kernel does not spill registers on Hopper (sm_90a) and
Blackwell (sm_100a). A spill-free choice is the precondition for speed, not
proof of it: no GPU has timed these yet. Registers and spill bytes as ptxas
reports them (``python -m graphcp.attention.kernels.paged_prefill_compile_check``; Triton 3.9,
group 4, LSE on; no GPU needed):

=========  ========  ==========================  ===========  ===========
dtype      head_dim  block_m/block_n/warps/stg   sm_90a       sm_100a
=========  ========  ==========================  ===========  ===========
bf16/fp16  <= 64     128 / 64 / 8 / 2            218 regs, 0  246 regs, 0
bf16/fp16  128       64 / 32 / 8 / 2             167 regs, 0  204 regs, 0
bf16/fp16  256       32 / 16 / 8 / 1             214 regs, 0  182 regs, 0
fp32       <= 64     32 / 32 / 4 / 2             206 regs, 0  198 regs, 0
fp32       128       16 / 16 / 4 / 1             159 regs, 0  168 regs, 0
fp32       256       16 / 16 / 4 / 1             206 regs, 0  168 regs, 0
=========  ========  ==========================  ===========  ===========

What spilled before (one 64 x 64 tile, 4 warps for every shape): bf16 at
head_dim 128 used 255 registers and 1.1-1.4 KB of stack a thread on sm_90a; the
float32 ("ieee" products, FMA dots, no tensor cores) variants spilled 10-17 KB.
Group sizes 1 and 8 stay spill-free too (the tightest: MHA at head_dim 64 on
sm_100a, 248 registers). Counts with every row and head offset an int64 product. Triton
3.6 (the GPU image's), group 4, LSE on: spill-free too, 125-246 registers (the most:
bf16 head_dim 128 on sm_100a).
``block_m`` counts *lanes*: query rows x the GQA group (rounded up to a power of
two) packed in one tile, so it is raised to the group's lanes when smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # lanes per tile: query rows x packed group heads
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int


#: (wide dtype, head_dim bound) -> config; the first row whose bound holds the head_dim
_TABLE: dict[bool, tuple[tuple[int, TileConfig], ...]] = {
    False: (  # 16-bit operands: tensor-core products
        (64, TileConfig(128, 64, 8, 2)),
        (128, TileConfig(64, 32, 8, 2)),
        (1 << 30, TileConfig(32, 16, 8, 1)),
    ),
    True: (  # float32 operands: IEEE products on FMA units, far more registers per element
        (64, TileConfig(32, 32, 4, 2)),
        (1 << 30, TileConfig(16, 16, 4, 1)),
    ),
}


def tile_config(head_dim: int, dtype: torch.dtype, group_lanes: int = 1) -> TileConfig:
    """Settings for ``head_dim`` and the operands' ``dtype``; ``block_m`` at least
    ``group_lanes`` (one query row of every head of a GQA group)."""
    wide = dtype == torch.float32
    for bound, cfg in _TABLE[wide]:
        if head_dim <= bound:
            break
    if cfg.block_m < group_lanes:
        cfg = TileConfig(group_lanes, cfg.block_n, cfg.num_warps, cfg.num_stages)
    return cfg
