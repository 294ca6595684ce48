"""Compile-only register and spill check of the Triton paged-decode kernel: no GPU.

As :mod:`~graphcp.attention.kernels.paged_prefill_compile_check`: ``triton.compile``
builds each variant for a CUDA target (sm_90a, sm_100a) and ``ptxas -v`` reports its
registers, spills and stack, for the settings
:func:`graphcp.attention.kernels.paged_decode_configs.decode_tile` picks: the decode
kernel with one split (it writes the output and the LSE) and with several (float32
partials), and the merge of the splits. Run it where the kernel is compiled, not
interpreted (``TRITON_INTERPRET`` unset or 0, before Triton is imported)::

    python -m graphcp.attention.kernels.paged_decode_compile_check --arch 90,100 --dtypes bfloat16,float32 \\
        --head-dims 64,128 --json report.json

``tests/test_triton_compile.py`` runs it for the bfloat16 variants at head_dim 64 and
128 on sm_90a and requires zero spills.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

from graphcp.attention.kernels.compile import DTYPES, PTR, KernelUsage, compile_kernel, csv_values, finish
from graphcp.attention.kernels.paged_decode_configs import decode_tile


@dataclass
class DecodeCompileReport(KernelUsage):
    """One variant of the decode kernel or its merge (built with keywords)."""

    arch: str  # "sm_90a"
    kernel: str  # "decode" or "merge"
    dtype: str
    head_dim: int
    group: int
    splits: int
    has_lse: bool
    block_n: int
    num_warps: int
    num_stages: int


def _signature(fn, pointers: dict[str, str]) -> dict[str, str]:
    out = {}
    for n in fn.arg_names:
        if n in pointers:
            out[n] = pointers[n]
        elif n == "qk_scale_log2":
            out[n] = "fp32"
        else:
            out[n] = "constexpr" if n.isupper() else "i32"
    return out


def compile_variant(arch: int, dtype: torch.dtype, head_dim: int, group: int, has_lse: bool, splits: int,
                    page_size: int = 16) -> list[DecodeCompileReport]:
    """Compile the decode kernel of ``splits`` splits (and, past one, its merge) for
    ``sm_<arch>a`` and read each one's resource use."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: the kernel would be interpreted, not compiled; unset it")
    from graphcp.attention.kernels import paged_decode as tk

    tile = decode_tile(head_dim, dtype)
    data, part = PTR[dtype], "*fp32" if splits > 1 else PTR[dtype]
    sig = _signature(tk._paged_decode_kernel, dict(Q=data, K_CACHE=data, V_CACHE=data, OUT=part, LSE="*fp32",
                                                    KV_LENS="*i32", PAGE_TABLE="*i32"))
    consts = dict(GROUP=group, GROUP_P=tk.group_lanes(group), PAGE_SIZE=page_size, HEAD_DIM=head_dim,
                  BLOCK_N=tile.block_n, PARTIAL=splits > 1, HAS_LSE=has_lse, UPCAST_DOT=False,
                  DOT_PRECISION="ieee" if dtype == torch.float32 else None)
    common = dict(arch=f"sm_{arch}a", dtype=str(dtype).removeprefix("torch."), head_dim=head_dim, group=group,
                  splits=splits, has_lse=has_lse, block_n=tile.block_n, num_warps=tile.num_warps)
    usage = compile_kernel(tk._paged_decode_kernel, sig, consts, arch, tile.num_warps, tile.num_stages,
                           tk.WIDE_STRIDES)
    reports = [DecodeCompileReport(kernel="decode", num_stages=tile.num_stages, **common, **usage)]
    if splits > 1:
        sig = _signature(tk._merge_splits_kernel, dict(O_PART="*fp32", L_PART="*fp32", OUT=data, LSE="*fp32"))
        consts = dict(HEAD_DIM=head_dim, SPLITS_P=tk.MAX_SPLITS, HAS_LSE=has_lse)
        usage = compile_kernel(tk._merge_splits_kernel, sig, consts, arch, tile.num_warps, 1)
        reports.append(DecodeCompileReport(kernel="merge", num_stages=1, **common, **usage))
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile the Triton decode kernel for CUDA targets and report "
                                "registers/spills")
    p.add_argument("--arch", default="90,100", help="compute capabilities as numbers (default %(default)s)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="operand dtypes (default %(default)s)")
    p.add_argument("--head-dims", default="64,128", help="(default %(default)s)")
    p.add_argument("--groups", default="4,8", help="GQA group sizes (default %(default)s)")
    p.add_argument("--splits", default="1,8", help="key splits (default %(default)s)")
    p.add_argument("--json", default=None, help="write the reports here as JSON")
    a = p.parse_args(argv)
    reports = []
    for arch in csv_values(a.arch, int):
        for name in csv_values(a.dtypes):
            if name not in DTYPES:
                p.error(f"--dtypes: {name!r} is not one of {sorted(DTYPES)}")
            for d in csv_values(a.head_dims, int):
                for g in csv_values(a.groups, int):
                    for s in csv_values(a.splits, int):
                        for has_lse in (True, False):
                            for r in compile_variant(arch, DTYPES[name], d, g, has_lse, s):
                                reports.append(r)
                                print(f"{r.arch} {r.kernel:6s} {r.dtype:8s} d={d:<4d} group={g} splits={s} "
                                      f"lse={int(has_lse)} {r.block_n}/w{r.num_warps}/s{r.num_stages}: "
                                      f"{r.usage_line()}", flush=True)
    return finish(reports, a.json)


if __name__ == "__main__":
    sys.exit(main())
