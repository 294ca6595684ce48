"""Start-up: graphcp's compiled host kernels (graphcp/jit.py) compiled, or loaded from
numba's on-disk cache, before the budget starts, so that none compiles inside a part's
share (a fresh machine has no cache: ~0.5 s a kernel on first use).

numba compiles a kernel for the argument types of its first call, so the warm-up calls
them the way the engine does: on the CPU (the host path is the same whatever the
device), an engine of the default preset at rank 3 of CP 8 prepares, fills and undoes a
prefill (new requests, then requests extending a cached prefix) and decode steps (one
token a request, a verify step of two rows whose second is given back); a token-sharded
engine at rank 1 of CP 2 does the same with the pass-KV ring (its ring plan and ledger
kernels); the
``default-hybrid`` preset runs a small varlen prefill (its linear layers' row kernels).
No forward but the hybrid's runs, and no collective is issued. The row says how many
kernels are ready and names any that are not (they compile on first use).
"""

from __future__ import annotations

import time

import numpy as np

from graphcp import jit
from graphcp.config import RuntimeConfig
from graphcp.dist import CPGroup
from graphcp.gpucheck.common import err, log
from graphcp.model.presets import ensure_preset
from graphcp.runtime.batch import Request
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import PrefillEngine


def _host_path(kv_cache: str, rank: int, cp: int, exchange: str = "auto") -> None:
    """Prepare, fill and undo a prefill and decode steps on one rank (no forward)."""
    rt = RuntimeConfig(device="cpu", graph="breakable", graph_backend="trace", check_consistency=False,
                       kv_tokens=1 << 14, kv_cache=kv_cache, exchange=exchange)
    engine = PrefillEngine(str(ensure_preset("default")), rt, CPGroup(rank=rank, size=cp),
                            BucketSet((256, 1024), padding_factor=64.0))
    parts, rng = engine.parts, np.random.default_rng(0)
    first = parts.preparer.prepare([Request(rng.integers(0, 1000, n)) for n in (40, 7, 300)])
    sel = parts.runner.select(first.plan.max_local_rows)
    parts.runner.fill(first, sel.capacity)
    handles = [parts.kv.handle(s) for s in first.seq_ids]  # (kept: the prefixes below extend them)
    ext = parts.preparer.prepare([Request(rng.integers(0, 1000, 9), handles[0]), Request(rng.integers(0, 1000, 5))])
    parts.preparer.abort(ext)
    planner = parts.decoder.preparer
    step = planner.prepare(handles, rng.integers(0, 1000, len(handles)))
    planner.abort(step)
    verify = planner.prepare(handles, rng.integers(0, 1000, (len(handles), 2)))
    keep = np.ones(len(handles), dtype=np.int64)
    keep[1] = 2
    planner.accept(verify, keep)  # the others' second rows given back
    for h in parts.kv.handles_after(handles):
        engine.release(h)


def _hybrid() -> None:
    engine = PrefillEngine(str(ensure_preset("default-hybrid")), RuntimeConfig(device="cpu", graph="off"), None)
    out = engine.prefill([Request(np.arange(24) % 1000), Request(np.arange(5) + 7)])
    for h in out.handles:
        engine.release(h)


WARMUPS = (("default, CP 8 rank 3, replicated", lambda: _host_path("replicated", 3, 8)),
           ("default, CP 2 rank 1, token-sharded", lambda: _host_path("sharded", 1, 2, "pass-kv")),
           ("default-hybrid, varlen prefill", _hybrid))


def precompile() -> dict:
    """Compile (or load) the host kernels; what is ready, how long it took, what failed."""
    t0 = time.perf_counter()
    errors = []
    for label, run in WARMUPS:
        try:
            run()
        except Exception as e:  # noqa: BLE001 - noted: those kernels compile on first use instead
            errors.append(f"{label}: {err(e)}")
    ready, defined, left = jit.compiled_count()
    res = {"numba": jit.COMPILED, "ready": ready, "defined": defined, "not_ready": left, "errors": errors,
           "seconds": round(time.perf_counter() - t0, 2)}
    log(f"host kernels: {ready}/{defined} compiled or loaded at start-up ({res['seconds']} s)"
        + (f"; not ready: {', '.join(left)}" if left else "") + (f"; errors: {'; '.join(errors)}" if errors else ""))
    return res
