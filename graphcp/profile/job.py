"""The per-rank job of ``graphcp profile``: set up a workload, warm up, run the
measured window under the profiler, write this rank's trace and summary.

Every forward restores the KV cache after itself (``rollback``), so the same
cached prefixes serve every pass and the cache never fills up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from graphcp.dist import CPGroup, barrier, gather_object
from graphcp.errors import InputError
from graphcp.jobs.quiet_profiler import without_kineto_log
from graphcp.jobs.spec import make_engine
from graphcp.kv.handle import KVCacheFull, KVHandle
from graphcp.nvtx_ranges import nvtx_range
from graphcp.profile.nsys import write_rank_pids
from graphcp.profile.summary import events_from_chrome_trace, rank_profile, write_rank
from graphcp.runtime.batch import Request
from graphcp.runtime.engine import PrefillEngine, prefill_prefixes

TOOLS = ("torch", "nvtx")  # torch: torch.profiler per rank; nvtx: ranges only, an outer nsys records


@dataclass
class ProfileJob:
    batches: list[tuple[list[int], list[int]]]  # (extend lengths, prefix lengths) per batch
    out_dir: str
    trace_dir: str
    warmup: int = 1  # passes over the workload before the window (lazy captures happen here)
    iters: int = 2  # measured passes
    tool: str = "torch"
    seed: int = 0


@dataclass
class _Batch:
    tokens: list[np.ndarray]
    prefixes: list[KVHandle | None] = field(default_factory=list)


def _setup(engine: PrefillEngine, job: ProfileJob) -> list[_Batch]:
    """Token ids (seeded: the same on every rank) and each batch's cached prefixes."""
    vocab = engine.cfg.vocab_size
    out = []
    for b, (ext, pre) in enumerate(job.batches):
        rng = np.random.default_rng(job.seed + b)
        batch = _Batch([rng.integers(0, vocab, n) for n in ext], [None] * len(ext))
        try:
            batch.prefixes = prefill_prefixes(engine, [rng.integers(0, vocab, p) if p > 0 else None for p in pre])
        except KVCacheFull as e:
            raise InputError(f"the workload's cached prefixes do not fit the KV pool ({e}); "
                             "pass a larger --kv-tokens or fewer --max-batches") from None
        out.append(batch)
    return out


def _forward(engine: PrefillEngine, batch: _Batch) -> None:
    out = engine.prefill([Request(t, h) for t, h in zip(batch.tokens, batch.prefixes)])
    # undo the new tokens: prefixes stay valid for the next pass, new sequences go away
    engine.parts.kv.rollback([h.seq_id for h in out.handles], [len(t) for t in batch.tokens])


def _pass(engine: PrefillEngine, batches: list[_Batch]) -> None:
    for b in batches:
        _forward(engine, b)


def _captures_ms(engine: PrefillEngine) -> dict[str, float]:
    if engine.parts.runner is None:
        return {}
    return {f"capture[{c.capacity}]": c.capture_s * 1e3 for c in engine.parts.runner.stats.captures}


def profile_rank(group: CPGroup, spec, job: ProfileJob) -> list[dict] | None:
    """Runs on every rank; rank 0 returns every rank's profile (JSON dicts)."""
    if job.tool not in TOOLS:
        raise ValueError(f"profile job tool must be one of {TOOLS}, got {job.tool!r}")
    engine = make_engine(group, spec)
    batches = _setup(engine, job)
    for _ in range(job.warmup):
        _pass(engine, batches)
    cuda = engine.device.type == "cuda"
    barrier(group)  # ranks enter the window together: waits in it are the forward's, not start-up skew
    meta = {"device": str(engine.device), "forwards": job.iters * len(batches)}
    if job.tool == "nvtx":
        with nvtx_range("measure"):
            for _ in range(job.iters):
                _pass(engine, batches)
            if cuda:
                torch.cuda.synchronize()
        pids = gather_object(group, os.getpid())
        if group.rank == 0:
            write_rank_pids(job.out_dir, pids)
        return None
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    trace = Path(job.trace_dir) / f"trace_rank{group.rank}.json"
    with without_kineto_log():
        with torch.profiler.profile(activities=acts) as prof:
            with nvtx_range("measure"):
                for _ in range(job.iters):
                    _pass(engine, batches)
                if cuda:
                    torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace))
    meta["trace"] = str(trace)
    rp = rank_profile(group.rank, events_from_chrome_trace(trace), _captures_ms(engine), meta)
    write_rank(job.out_dir, rp)
    everyone = gather_object(group, rp.to_json())
    return everyone if group.rank == 0 else None
