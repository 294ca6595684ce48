"""Compile-only register and spill check of the Triton sparse latent-attention kernel: no GPU.

Builds :mod:`graphcp.attention.kernels.sparse_latent` for CUDA targets with the settings
:func:`graphcp.attention.kernels.sparse_latent_configs.sparse_tile_config` picks, through the
dense kernel's helper (:func:`graphcp.attention.kernels.paged_prefill_compile_check.compile_kernel`),
and reports what ptxas says. Run it where the kernel is compiled, not interpreted
(``TRITON_INTERPRET`` unset or 0)::

    python -m graphcp.attention.kernels.sparse_latent_compile_check --arch 90,100 --dtypes bfloat16,float32 \\
        --latent 512:64,32:8

(``kv_lora_rank:qk_rope_head_dim``; 512:64 is DeepSeek V3.2's and GLM-5's). Exit 1
when a variant spills.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from graphcp.attention.kernels.compile import DTYPES, PTR, KernelUsage, compile_kernel, csv_values, finish
from graphcp.attention.kernels.sparse_latent_configs import SparseTileConfig, sparse_tile_config


@dataclass
class SparseCompileReport(KernelUsage):
    """One variant of the sparse latent-attention kernel (built with keywords: the usage fields come first)."""

    arch: str  # "sm_90a"
    dtype: str
    kv_lora_rank: int
    rope_dim: int
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int


def compile_sparse_variant(arch: int, dtype: torch.dtype, kv_lora_rank: int, rope_dim: int,
                           cfg: SparseTileConfig | None = None, page_size: int = 64) -> SparseCompileReport:
    """Compile the sparse latent-attention kernel for ``sm_<arch>a`` and read its resource use."""
    from graphcp.attention.kernels import sparse_latent as sk  # imports triton: compiled only without TRITON_INTERPRET

    cfg = cfg or sparse_tile_config(kv_lora_rank, dtype)
    fn = sk.kernel()
    sig = {}
    for n in fn.arg_names:
        if n in ("Q_LAT", "Q_ROPE", "CACHE", "OUT"):
            sig[n] = PTR[dtype]
        elif n in ("SELECTED", "COUNTS", "ROW_TABLE", "PAGE_TABLE"):
            sig[n] = "*i32"
        elif n == "qk_scale_log2":
            sig[n] = "fp32"
        elif n.isupper():
            sig[n] = "constexpr"
        else:
            sig[n] = "i32"
    consts = dict(KV_LORA=kv_lora_rank, ROPE=rope_dim, LORA_P=sk.padded(kv_lora_rank), ROPE_P=sk.padded(rope_dim),
                  PAGE_SIZE=page_size, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, UPCAST_DOT=False,
                  DOT_PRECISION="ieee" if dtype == torch.float32 else None)
    usage = compile_kernel(fn, sig, consts, arch, cfg.num_warps, cfg.num_stages, sk.WIDE_STRIDES)
    return SparseCompileReport(arch=f"sm_{arch}a", dtype=str(dtype).removeprefix("torch."), kv_lora_rank=kv_lora_rank,
                               rope_dim=rope_dim, block_h=cfg.block_h, block_n=cfg.block_n, num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages, **usage)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile the sparse latent-attention Triton kernel for CUDA targets; "
                                            "report registers/spills")
    p.add_argument("--arch", default="90,100", help="compute capabilities as numbers (default %(default)s)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="operand dtypes (default %(default)s)")
    p.add_argument("--latent", default="512:64", help="kv_lora_rank:rope_dim pairs (default %(default)s)")
    p.add_argument("--json", default=None, help="write the reports here as JSON")
    a = p.parse_args(argv)
    reports = []
    for arch in csv_values(a.arch):
        for name in csv_values(a.dtypes):
            if name not in DTYPES:
                p.error(f"--dtypes: {name!r} is not one of {sorted(DTYPES)}")
            for pair in csv_values(a.latent):
                lora, _, rope = pair.partition(":")
                if not (lora.isdigit() and rope.isdigit()):
                    p.error(f"--latent: {pair!r} is not kv_lora_rank:rope_dim (two integers)")
                r = compile_sparse_variant(int(arch), DTYPES[name], int(lora), int(rope))
                reports.append(r)
                print(f"{r.arch} {r.dtype:8s} latent={r.kv_lora_rank}:{r.rope_dim} "
                      f"{r.block_h}/{r.block_n}/w{r.num_warps}/s{r.num_stages}: {r.usage_line()}", flush=True)
    return finish(reports, a.json)


if __name__ == "__main__":
    sys.exit(main())
