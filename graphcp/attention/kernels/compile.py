"""Compiling a Triton kernel for a CUDA target without a GPU and reading what ptxas
reports (registers, spills, stack, shared memory): the step both kernels' compile-only
checks share (:mod:`~graphcp.attention.kernels.paged_prefill_compile_check`,
:mod:`~graphcp.attention.kernels.sparse_latent_compile_check`), and their flag parsing and
report writing."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

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
    narrow_strides: list[str]  # wide strides the TTIR multiplies in 32 bits (:func:`narrow_strides`)

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0

    @property
    def failed(self) -> bool:
        """A spill or a 32-bit offset product: the check's exit code is 1."""
        return self.spills or bool(self.narrow_strides)

    def usage_line(self) -> str:
        narrow = f", 32-bit products of {', '.join(self.narrow_strides)}" if self.narrow_strides else ""
        return (f"{self.registers} regs, spill {self.spill_store_bytes}/{self.spill_load_bytes} B, "
                f"stack {self.stack_bytes} B, shared {self.shared_bytes} B{narrow} ({self.seconds} s)")


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


def narrow_strides(ttir: str, wide: tuple[str, ...]) -> list[str]:
    """The arguments of ``wide`` (i32 strides the kernel promises to multiply in int64) that
    the kernel's TTIR uses other than by widening them first (``arith.extsi %s : i32 to
    i64``): Triton passes an integer below 2**31 as i32, and an i32 x i32 offset product
    wraps past 2**31 elements (an illegal access, or a read of the wrong row)."""
    out = []
    for name in wide:
        uses = [ln.strip() for ln in ttir.splitlines()
                if re.search(rf"%{name}\b(?!:)", ln) and "tt.func" not in ln]
        if any(not re.search(rf"arith\.extsi %{name} : i32 to i64", u) for u in uses):  # unused: fine
            out.append(name)
    return out


def compile_kernel(fn, signature: dict[str, str], constexprs: dict[str, object], arch: int, num_warps: int,
                   num_stages: int, wide: tuple[str, ...] = ()) -> dict[str, int | float | list[str]]:
    """Compile jitted ``fn`` for ``sm_<arch>a`` (``signature``: every argument's type,
    ``"constexpr"`` for those in ``constexprs``) and read its resource use with ``ptxas
    -v``: ``registers``, ``spill_store_bytes``, ``spill_load_bytes``, ``stack_bytes``,
    ``shared_bytes``, ``seconds``; and ``narrow_strides``, those of ``wide`` its TTIR
    multiplies in 32 bits (:func:`narrow_strides`). Any Triton kernel (the dense and the
    sparse latent-attention ones)."""
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
                seconds=round(time.perf_counter() - t0, 2), narrow_strides=narrow_strides(compiled.asm["ttir"], wide))


def csv_values(s: str, cast=str) -> list:
    """A flag's comma-separated values."""
    return [cast(x) for x in s.split(",") if x.strip()]


def finish(reports: list[KernelUsage], json_path: str | None) -> int:
    """Write the reports as JSON (when asked); the exit code: 1 if a variant spills or
    multiplies a wide stride in 32 bits."""
    if json_path:
        Path(json_path).write_text(json.dumps([asdict(r) for r in reports], indent=1) + "\n")
    return 1 if any(r.failed for r in reports) else 0
