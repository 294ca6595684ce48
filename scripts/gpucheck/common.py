"""Settings, the time budget and the environment of one GPU-check run."""

from __future__ import annotations

import gc
import importlib.util
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field

import torch

SCHEMA_VERSION = 2
LARGE_MODEL = "qwen3-1b-like"
#: the parts of a run, in order, with the seconds each may take on one H200 (docs/gpu_check.md);
#: time a part leaves unused passes to the next
PHASES = {"warmup": 45.0, "kernels": 45.0, "graphs": 60.0, "timing": 180.0, "launches": 40.0}
DRY_PHASES = {"warmup": 20.0, "kernels": 40.0, "graphs": 60.0, "timing": 60.0, "launches": 20.0}
FLASHINFER_ABSENT = ("flashinfer is not installed here: its wheel (~100 MB) is larger than what travels to the "
                     "device machine (64 MiB with the working tree), so the flashinfer and trtllm backends are "
                     "not checked on it")


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


@dataclass
class Settings:
    """Everything a run needs, resolved from the command line (and --dry-run)."""

    dry_run: bool
    device: str
    graph_backend: str  # cuda | trace
    # kernel check
    check_dtypes: tuple[str, ...]
    check_heads: tuple[tuple[int, int, int], ...]  # (q heads, kv heads, head_dim)
    check_random_plans: int
    check_max_extend: int
    check_max_prefix: int
    page_size: int
    # graph check (default model, CP = 1)
    graph_dtypes: tuple[str, ...]
    graph_attention: dict[str, str]  # graph mode -> attention backend
    graph_buckets: tuple[int, ...]
    graph_batches: tuple[tuple[int, ...], ...]  # new tokens per request, one tuple a batch
    # timing
    timing_dtype: str
    models: tuple[str, ...]
    large_layers: int | None
    sizes: tuple[int, ...]
    timing_backends: tuple[str, ...]
    repeats: int
    warmup: int
    item_cap_s: float
    profile: bool
    seed: int
    phases: dict[str, float] = field(default_factory=dict)


class Budget:
    """Wall-clock budget: a total, and a share per part (:data:`PHASES`). A part
    may use its share plus whatever earlier parts left; nothing starts past the
    total minus ``reserve_s`` (kept for the report)."""

    def __init__(self, total_s: float, phases: dict[str, float], reserve_s: float) -> None:
        self.total_s, self.reserve_s = total_s, reserve_s
        self.phases = dict(phases)
        self.t0 = time.perf_counter()
        self.used: dict[str, float] = {}
        self._phase: str | None = None
        self._phase_end = self.t0 + total_s
        self._phase_t0 = self.t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def start(self, phase: str) -> None:
        self.stop()
        now = time.perf_counter()
        earlier = sum(s for name, s in self.phases.items() if name in self.used)
        carry = max(0.0, earlier - (now - self.t0))
        self._phase, self._phase_t0 = phase, now
        self._phase_end = now + self.phases.get(phase, 0.0) + carry

    def stop(self) -> None:
        if self._phase is not None:
            self.used[self._phase] = round(time.perf_counter() - self._phase_t0, 2)
            self._phase = None

    def remaining(self) -> float:
        now = time.perf_counter()
        total_left = self.total_s - self.reserve_s - (now - self.t0)
        return min(total_left, self._phase_end - now)

    def allows(self, need_s: float) -> bool:
        return self.remaining() >= need_s


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


def env_info() -> dict:
    import importlib.metadata as md

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    from graphcp.profile import ranges as profiling

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": version("triton"),
            "flashinfer": version("flashinfer-python") or version("flashinfer"),
            "flashinfer_importable": importlib.util.find_spec("flashinfer") is not None,
            "nvtx": profiling.NVTX_AVAILABLE, "python": platform.python_version(),
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}
