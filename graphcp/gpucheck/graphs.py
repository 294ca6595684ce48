"""Graph replay equals the same-bucket eager body, bitwise: the ``cuda`` graph
backend (``trace`` in a dry run) in breakable and full mode at CP = 1, default
model, Triton attention (a dry run breaks to torch attention), per dtype.

Each batch is prepared once; the replay's output rows are kept, then the very
same body runs eagerly on the same bucket and static buffers
(``GraphRunner.eager_on_bucket``) and must match bit for bit. The unpadded eager
body gives the (non-bitwise) difference a real forward sees. The capture
self-check (``RuntimeConfig.verify_capture``) is on, so a bucket whose
capture-time replay differs fails at capture.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from graphcp.config import RuntimeConfig
from graphcp.gpucheck.budget import Budget
from graphcp.gpucheck.common import TIME_BUDGET, fail, free_device_memory, log
from graphcp.gpucheck.settings import Settings
from graphcp.runtime.batch import Request
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.capture.graphs import CaptureError
from graphcp.runtime.capture.runner import Fallback
from graphcp.runtime.engine import PrefillEngine

MODES = ("breakable", "full")


def _engine(st: Settings, dtype: str, graph: str, attention: str) -> PrefillEngine:
    kv_tokens = 2 * max(st.graph_buckets) + 8 * st.page_size
    rt = RuntimeConfig(device=st.device, dtype=dtype, graph=graph, attention=attention, kv_tokens=kv_tokens,
                       page_size=st.page_size, graph_backend=st.graph_backend, max_requests=4, verify_capture=True)
    return PrefillEngine("default", rt, None, BucketSet(st.graph_buckets, padding_factor=64.0))


def compare_replay(engine: PrefillEngine, batch: list[Request], label: str) -> dict:
    """Replay ``batch`` and run the same bucket's body eagerly: bitwise equal? (A batch the
    graphs did not take is a ``fallback``: the run fails, a graph was asked.)"""
    prep = engine.parts.preparer.prepare(batch)
    try:
        got = engine.parts.runner.try_replay(prep)
        if isinstance(got, Fallback):
            return {"batch": label, "status": "fallback", "error": got.reason}
        hidden, info = got
        replay = hidden.clone()
        same_bucket = engine.parts.runner.eager_on_bucket(prep, info.capacity).clone()
        n = prep.ids.shape[0]
        unpadded = engine.parts.body.eager(prep, prep.plan.max_local_rows)[:n].float()
        diff = (replay.float() - same_bucket.float()).abs().max()
        ref = unpadded.norm().clamp_min(1e-30)
        return {"batch": label, "bucket": info.capacity, "rows": int(n),
                "bitwise_equal": bool(torch.equal(replay, same_bucket)), "max_abs_diff": float(diff),
                "rel_diff_vs_unpadded_eager": float((replay[:n].float() - unpadded).norm() / ref),
                "status": "pass" if torch.equal(replay, same_bucket) else "fail"}
    finally:
        engine.parts.preparer.abort(prep)


def _check_engine(engine: PrefillEngine, st: Settings, budget: Budget, row: dict) -> None:
    """Capture, then every batch of the settings and a cached-prefix extension: results into ``row``."""
    t0 = time.perf_counter()
    stats = engine.capture()
    row["capture_s"] = round(time.perf_counter() - t0, 2)
    row["segments_breaks"] = {s.capacity: [s.segments, s.breaks] for s in stats}
    row["self_check"] = "passed"
    rng = np.random.default_rng(st.seed)
    vocab = engine.cfg.vocab_size
    for lens in st.graph_batches:
        if not budget.allows(3.0):
            row["batches"].append({"batch": str(list(lens)), "status": "skipped", "error": TIME_BUDGET})
            continue
        batch = [Request(rng.integers(0, vocab, n)) for n in lens]
        row["batches"].append(compare_replay(engine, batch, str(list(lens))))
    # a cached prefix: prefill one request, then extend it on the graph path
    first = engine.prefill([Request(rng.integers(0, vocab, st.graph_batches[0][0] // 2))])
    h = first.handles[0]
    ext = [Request(rng.integers(0, vocab, st.graph_batches[0][0] // 3), h), Request(rng.integers(0, vocab, 5))]
    row["batches"].append(compare_replay(engine, ext, f"[{h.num_tokens}+{len(ext[0].tokens)}, 5]"))
    engine.release(h)
    judge_batches(row)


def judge_batches(row: dict) -> None:
    """A row's status from its batches': pass when every batch passed; fail when one
    differs or ran eagerly (a graph was asked); error when one raised; skipped (for time)
    when the rest passed but not every batch ran."""
    statuses = {b["status"] for b in row["batches"]}
    if statuses == {"pass"}:
        row["status"] = "pass"
        return
    bad = [b for b in row["batches"] if b["status"] != "pass"]
    if statuses <= {"pass", "skipped"}:
        row.update(status="skipped", error=TIME_BUDGET)
        return
    row["status"] = "fail" if statuses & {"fail", "fallback"} else "error"
    row["error"] = "; ".join(f"{b['batch']}: {b['status']} {b.get('error') or ''}".strip() for b in bad)


def check_graphs(st: Settings, budget: Budget) -> list[dict]:
    device = torch.device(st.device)
    rows = []
    for dtype in st.graph_dtypes:
        for mode in MODES:
            attention = st.graph_attention[mode]
            row = {"dtype": dtype, "graph": mode, "attention": attention, "graph_backend": st.graph_backend,
                   "buckets": list(st.graph_buckets), "self_check": None, "batches": [], "status": "pending"}
            rows.append(row)
            if not budget.allows(10.0):
                row.update(status="skipped", error=TIME_BUDGET)
                continue
            engine = None
            try:
                engine = _engine(st, dtype, mode, attention)
                _check_engine(engine, st, budget, row)
                log(f"graphs {dtype} {mode}: {row['status']} "
                    f"({sum(b.get('bitwise_equal', False) for b in row['batches'])}/{len(row['batches'])} bitwise)")
            except Exception as e:  # noqa: BLE001 - a capture self-check failure lands here too
                fail(row, f"graphs {dtype} {mode}", e, "fail" if isinstance(e, CaptureError) else "error")
            finally:
                del engine
                free_device_memory(device)
    return rows
