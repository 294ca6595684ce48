"""Compile-only register and spill check of the Triton paged-prefill kernel: no GPU.

``triton.compile`` builds the kernel for a CUDA target (sm_90a, sm_100a) on any
machine with Triton's NVIDIA backend (it ships ``ptxas``); ``ptxas -v`` on the
generated PTX then reports registers, spill stores/loads and the stack frame of
each variant, for the settings :func:`graphcp.attention.kernels.paged_prefill_configs.tile_config`
picks. Run it where the kernel is compiled, not interpreted (``TRITON_INTERPRET``
unset or 0, before Triton is imported)::

    python -m graphcp.attention.kernels.paged_prefill_compile_check --arch 90,100 --dtypes bfloat16,float32 \\
        --head-dims 64,128 --json report.json

:func:`~graphcp.attention.kernels.compile.compile_kernel` is the compile + ptxas step
for any Triton kernel (the sparse latent-attention kernel's check uses it too).
``tests/test_triton_compile.py`` runs it for the bfloat16 variants at head_dim 64
and 128 on sm_90a and requires zero spills.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

from graphcp.attention.kernels.compile import DTYPES, PTR, KernelUsage, compile_kernel, csv_values, finish
from graphcp.attention.kernels.paged_prefill_configs import TileConfig, tile_config


@dataclass
class CompileReport(KernelUsage):
    """One variant of the dense attention kernel (built with keywords: the usage fields
    come first)."""

    arch: str  # "sm_90a"
    dtype: str
    head_dim: int
    group: int
    has_lse: bool
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def compile_variant(arch: int, dtype: torch.dtype, head_dim: int, group: int, has_lse: bool,
                    cfg: TileConfig | None = None, page_size: int = 16) -> CompileReport:
    """Compile one variant of the paged-prefill kernel for ``sm_<arch>a`` and read its resource use."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: the kernel would be interpreted, not compiled; unset it")
    from graphcp.attention.kernels import paged_prefill as tk

    lanes = tk.group_lanes(group)
    cfg = cfg or tile_config(head_dim, dtype, lanes)
    fn = tk._paged_prefill_kernel
    sig = {}
    for n in fn.arg_names:
        if n in ("Q", "K_CACHE", "V_CACHE", "OUT"):
            sig[n] = PTR[dtype]
        elif n == "LSE":
            sig[n] = "*fp32"
        elif n in ("CU_SEQLENS_Q", "KV_LENS", "PAGE_TABLE"):
            sig[n] = "*i32"
        elif n == "qk_scale_log2":
            sig[n] = "fp32"
        elif n.isupper():
            sig[n] = "constexpr"
        else:
            sig[n] = "i32"
    consts = dict(GROUP=group, GROUP_P=lanes, PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, SEARCH_STEPS=tk.search_steps(16), HAS_LSE=has_lse, UPCAST_DOT=False,
                  DOT_PRECISION="ieee" if dtype == torch.float32 else None, CAUSAL=True)
    usage = compile_kernel(fn, sig, consts, arch, cfg.num_warps, cfg.num_stages, tk.WIDE_STRIDES)
    return CompileReport(arch=f"sm_{arch}a", dtype=str(dtype).removeprefix("torch."), head_dim=head_dim, group=group,
                         has_lse=has_lse, block_m=cfg.block_m, block_n=cfg.block_n, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages, **usage)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile the Triton kernel for CUDA targets and report registers/spills")
    p.add_argument("--arch", default="90,100", help="compute capabilities as numbers (default %(default)s)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="operand dtypes (default %(default)s)")
    p.add_argument("--head-dims", default="64,128", help="(default %(default)s)")
    p.add_argument("--groups", default="4", help="GQA group sizes (default %(default)s)")
    p.add_argument("--lse", default="both", choices=("both", "on", "off"), help="LSE variants (default %(default)s)")
    p.add_argument("--json", default=None, help="write the reports here as JSON")
    a = p.parse_args(argv)
    lse = {"both": (True, False), "on": (True,), "off": (False,)}[a.lse]
    reports = []
    for arch in csv_values(a.arch, int):
        for name in csv_values(a.dtypes):
            if name not in DTYPES:
                p.error(f"--dtypes: {name!r} is not one of {sorted(DTYPES)}")
            for d in csv_values(a.head_dims, int):
                for g in csv_values(a.groups, int):
                    for has_lse in lse:
                        r = compile_variant(arch, DTYPES[name], d, g, has_lse)
                        reports.append(r)
                        print(f"{r.arch} {r.dtype:8s} d={d:<4d} group={g} lse={int(has_lse)} "
                              f"{r.block_m}/{r.block_n}/w{r.num_warps}/s{r.num_stages}: {r.usage_line()}", flush=True)
    return finish(reports, a.json)


if __name__ == "__main__":
    sys.exit(main())
