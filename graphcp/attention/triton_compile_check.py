"""Compile-only register and spill check of the Triton paged-prefill kernel: no GPU.

``triton.compile`` builds the kernel for a CUDA target (sm_90a, sm_100a) on any
machine with Triton's NVIDIA backend (it ships ``ptxas``); ``ptxas -v`` on the
generated PTX then reports registers, spill stores/loads and the stack frame of
each variant, for the settings :func:`graphcp.attention.triton_configs.tile_config`
picks. Run it where the kernel is compiled, not interpreted (``TRITON_INTERPRET``
unset or 0, before Triton is imported)::

    python -m graphcp.attention.triton_compile_check --arch 90,100 --dtypes bfloat16,float32 \\
        --head-dims 64,128 --json report.json

:func:`compile_kernel` is the compile + ptxas step for any Triton kernel (the sparse MLA
kernel's check, ``sparse_mla_compile_check``, uses it too).
``tests/test_triton_compile.py`` runs it for the bfloat16 variants at head_dim 64
and 128 on sm_90a and requires zero spills.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from graphcp.attention.triton_configs import TileConfig, tile_config

PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class KernelUsage:
    """What ptxas reports for one compiled kernel (:func:`compile_kernel`)."""

    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    shared_bytes: int
    seconds: float

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0

    def usage_line(self) -> str:
        return (f"{self.registers} regs, spill {self.spill_store_bytes}/{self.spill_load_bytes} B, "
                f"stack {self.stack_bytes} B, shared {self.shared_bytes} B ({self.seconds} s)")


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


def _ptxas(arch: int) -> str:
    """The ptxas Triton itself uses for ``arch`` (its own copy, whatever the version)."""
    from triton.backends.nvidia import compiler as nv

    get = getattr(nv, "get_ptxas", None)
    if get is not None:
        try:
            return get(arch).path
        except TypeError:  # older Triton: get_ptxas() takes no arch
            return get().path
    import triton

    path = getattr(getattr(getattr(triton, "knobs", None), "nvidia", None), "ptxas", None)
    if path is not None:
        return path.path
    found = shutil.which("ptxas")
    if found is None:
        raise RuntimeError("no ptxas found (Triton's NVIDIA backend ships one)")
    return found


def _ptxas_flags() -> list[str]:
    """Register-allocation flags Triton passes to ptxas itself, so the count matches its cubin."""
    from triton.backends.nvidia import compiler as nv

    return ["--regAllocOptLevel=2"] if "regAllocOptLevel" in inspect.getsource(nv) else []


def parse_ptxas_log(log: str) -> dict[str, int]:
    """Registers, spill stores/loads and stack frame from ``ptxas -v`` output."""
    regs = re.search(r"Used (\d+) registers", log)
    if regs is None:
        raise RuntimeError(f"no register count in the ptxas log:\n{log}")
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return {
        "registers": int(regs.group(1)),
        "spill_store_bytes": int(spill.group(1)) if spill else 0,
        "spill_load_bytes": int(spill.group(2)) if spill else 0,
        "stack_bytes": int(stack.group(1)) if stack else 0,
    }


def compile_kernel(fn, signature: dict[str, str], constexprs: dict[str, object], arch: int, num_warps: int,
                   num_stages: int) -> dict[str, int | float]:
    """Compile jitted ``fn`` for ``sm_<arch>a`` (``signature``: every argument's type,
    ``"constexpr"`` for those in ``constexprs``) and read its resource use with ``ptxas
    -v``: ``registers``, ``spill_store_bytes``, ``spill_load_bytes``, ``stack_bytes``,
    ``shared_bytes``, ``seconds``. Any Triton kernel (the dense and the sparse MLA ones)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: the kernel would be interpreted, not compiled; unset it")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    t0 = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    gpu = f"sm_{arch}a"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        proc = subprocess.run([_ptxas(arch), "-v", *_ptxas_flags(), f"--gpu-name={gpu}", str(ptx), "-o",
                               str(ptx.with_suffix(".cubin"))], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed for {gpu}: {proc.stderr[-2000:]}")
    return dict(parse_ptxas_log(proc.stderr + proc.stdout), shared_bytes=int(compiled.metadata.shared),
                seconds=round(time.perf_counter() - t0, 2))


def compile_variant(arch: int, dtype: torch.dtype, head_dim: int, group: int, has_lse: bool,
                    cfg: TileConfig | None = None, page_size: int = 16) -> CompileReport:
    """Compile one variant of the paged-prefill kernel for ``sm_<arch>a`` and read its resource use."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: the kernel would be interpreted, not compiled; unset it")
    from graphcp.attention import triton_kernel as tk

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
    usage = compile_kernel(fn, sig, consts, arch, cfg.num_warps, cfg.num_stages)
    return CompileReport(arch=f"sm_{arch}a", dtype=str(dtype).removeprefix("torch."), head_dim=head_dim, group=group,
                         has_lse=has_lse, block_m=cfg.block_m, block_n=cfg.block_n, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages, **usage)


def csv_values(s: str, cast=str) -> list:
    """A flag's comma-separated values."""
    return [cast(x) for x in s.split(",") if x.strip()]


def finish(reports: list[KernelUsage], json_path: str | None) -> int:
    """Write the reports as JSON (when asked); the exit code: 1 if a variant spills."""
    if json_path:
        Path(json_path).write_text(json.dumps([asdict(r) for r in reports], indent=1) + "\n")
    return 1 if any(r.spills for r in reports) else 0


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
