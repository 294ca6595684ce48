"""Logging, device and environment facts of one GPU-check run."""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
import time
import traceback
from collections.abc import Iterator

import torch

from graphcp import jit
from graphcp import nvtx_ranges as ranges
from graphcp.gpucheck.report import TIME_BUDGET  # noqa: F401 - the parts' skip reason, re-exported for them
from graphcp.pd import safetensors_lib

FLASHINFER_ABSENT = ("flashinfer is not installed: the flashinfer and trtllm attention backends were not checked "
                     "(they need a GPU and pip install -e \".[flashinfer]\")")


def log(msg: str) -> None:
    """Progress on stderr (stdout carries the Markdown summary, last)."""
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


def log_error(where: str, e: BaseException) -> None:
    """One line for the error, then the last frames of its traceback."""
    log(f"{where}: ERROR {err(e)}")
    log("".join(traceback.format_exception(e)[-3:]).rstrip())


def fail(rec: dict, where: str, e: BaseException, status: str = "error", note: str = "") -> None:
    """Mark a result row failed by ``e`` (the run goes on) and log it."""
    rec.update(status=status, error=err(e) + note)
    log_error(where, e)


def skip(rec: dict, reason: str) -> dict:
    """Mark a result row skipped (not run), with why."""
    rec.update(status="skipped", error=reason)
    return rec


def dtype_rows(out: list[dict], dtypes: tuple[str, ...], base: dict, budget) -> Iterator[tuple[int, str, dict]]:
    """A pending result row per dtype appended to ``out``; yields (index, dtype name, row)
    for each the budget still allows a second for, the others become ``skipped``."""
    for i, name in enumerate(dtypes):
        rec = {**base, "dtype": name, "status": "pending", "error": None}
        out.append(rec)
        if not budget.allows(1.0):
            skip(rec, TIME_BUDGET)
            continue
        yield i, name, rec


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        mem = torch.cuda.get_device_properties(device).total_memory
    else:
        name, cap, mem = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", None, None
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    slug = f"gpu-{slug}" if device.type == "cuda" else "cpu-dry-run"
    return {"type": device.type, "name": name, "capability": cap, "total_memory_bytes": mem, "slug": slug}


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def env_info() -> dict:
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": _version("triton"),
            "flashinfer": _version("flashinfer-python") or _version("flashinfer"),
            "flashinfer_importable": importlib.util.find_spec("flashinfer") is not None,
            "safetensors_problem": safetensors_lib.problem(),
            "nvtx": ranges.NVTX_AVAILABLE, "host_kernels_compiled": jit.COMPILED, "python": platform.python_version(),
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}
