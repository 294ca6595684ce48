"""One rank's host preparation before a replay, timed on its own: validation, KV
reservation, plan, this rank's inputs and the fill of the static buffers (with their
uploads), and the undo, for 16 requests at C = 8 (rank 3 of the layout; no collective is
issued): the ledger's case (docs/performance.md, ``benchmarks/bench_graph.py``; its target
is a median of 50 us). The row says which host kernels ran: compiled (numba), or their
numpy twins and Python (graphcp/jit.py). A measurement, not a check: its status says it ran.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from graphcp import jit
from graphcp.config import RuntimeConfig
from graphcp.dist import CPGroup
from graphcp.gpucheck.budget import Budget
from graphcp.gpucheck.common import TIME_BUDGET, fail, free_device_memory, log, skip
from graphcp.gpucheck.settings import Settings
from graphcp.runtime.batch import Request
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import PrefillEngine

#: the ledger's two mixes of 16 requests: new tokens drawn from [lo, hi)
KINDS = {"16 requests, 64..512 tokens": (64, 513), "16 requests, 1..2000 tokens": (1, 2001)}
TARGET_US = 50.0


def _step(engine: PrefillEngine, batch: list[Request]) -> None:
    prep = engine.parts.preparer.prepare(batch)
    try:
        sel = engine.parts.runner.select(prep.plan.max_local_rows)
        if not sel.graph:
            raise RuntimeError(f"{sel.required} rows a rank take no bucket ({sel.reason})")
        engine.parts.runner.fill(prep, sel.capacity)
    finally:
        engine.parts.preparer.abort(prep)


def time_host(st: Settings, budget: Budget) -> list[dict]:
    """One row per mix: median and min microseconds of ``st.host_repeats`` preparations."""
    device = torch.device(st.device)
    compiled = "compiled (numba)" if jit.COMPILED else "numpy twins and Python (no numba)"
    rows = [{"case": kind, "cp": st.host_cp, "rank": 3, "requests": st.host_requests, "host_kernels": compiled,
             "target_us": TARGET_US, "status": "pending"} for kind in KINDS]
    if not budget.allows(5.0):
        return [skip(row, TIME_BUDGET) for row in rows]
    engine = None
    try:
        rt = RuntimeConfig(device=st.device, graph="breakable", check_consistency=False, kv_tokens=1 << 16,
                           graph_backend=st.graph_backend)
        engine = PrefillEngine("default", rt, CPGroup(rank=3, size=st.host_cp), BucketSet((256, 512, 1024, 2048, 4096)))
        for row, (lo, hi) in zip(rows, KINDS.values()):
            if not budget.allows(2.0):
                skip(row, TIME_BUDGET)
                continue
            rng = np.random.default_rng(st.seed + 1)
            batch = [Request(rng.integers(0, engine.cfg.vocab_size, n)) for n in rng.integers(lo, hi, st.host_requests)]
            _step(engine, batch)  # the kernels load (or compile) on first use: not what is timed
            times = []
            for _ in range(st.host_repeats):
                t0 = time.perf_counter()
                _step(engine, batch)
                times.append(time.perf_counter() - t0)
            median = 1e6 * float(np.median(times))
            row.update(tokens=sum(len(r.tokens) for r in batch), median_us=median, min_us=1e6 * min(times),
                       repeats=len(times), vs_target=median / TARGET_US, status="ok")
            log(f"host preparation, {row['case']}: median {median:.1f} us ({compiled})")
    except Exception as e:  # noqa: BLE001 - recorded
        for row in rows:
            if row["status"] == "pending":
                fail(row, "host preparation", e)
    finally:
        del engine
        free_device_memory(device)
    return rows
