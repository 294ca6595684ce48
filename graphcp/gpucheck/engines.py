"""Engines beyond the dense model, end to end at CP 1 (what one GPU can run):

- DeepSeek V4 (``default-v4``): its attention in the break (the torch reference), its hash
  and score-routed experts;
- a MoE model (``default-moe``) with ``moe='tp'`` (on CUDA its experts are held out of the
  graphs, in the attention break, until a captured grouped matmul is validated: the row
  says whether they were) and with ``moe='ep'`` (the exchange in the break);
- an EAGLE-3 draft (seeded random, :mod:`graphcp.gpucheck.draft_model`) whose graphs run
  after the target's, ``breakable`` and ``full``;
- decode (the default model): a few steps of a batch on its decode graph, the first
  replay self-checked against the same step run eagerly on the bucket.

Per engine: one bucket captured (the capture self-check on), then a batch extending a
cached prefix. It passes when the replay equals the same bucket's eager body bit for bit
(the draft: its replay equals the draft run eagerly on the bucket; decode: the self-check
of its first replay), the prefill (every decode step) took the graph (a fallback fails: a
graph was asked) and its logits are within :data:`graphcp.jobs.tolerance.RUN_TOLERANCE`
of the eager path's.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from graphcp.config import RuntimeConfig
from graphcp.gpucheck.budget import Budget
from graphcp.gpucheck.common import TIME_BUDGET, fail, free_device_memory, log, skip
from graphcp.gpucheck.draft_model import ensure_random_draft
from graphcp.gpucheck.graphs import compare_replay, judge_batches
from graphcp.gpucheck.settings import Settings
from graphcp.jobs.tolerance import RUN_TOLERANCE
from graphcp.model.eagle3.shift import draft_input_ids
from graphcp.model.moe.block import SparseMoeBlock
from graphcp.model.presets import ensure_preset
from graphcp.runtime.batch import Request
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.capture.graphs import CaptureError
from graphcp.runtime.capture.runner import Fallback
from graphcp.runtime.engine import PrefillEngine

#: (label, preset, RuntimeConfig overrides): the model engines, float32 (a router's near-tie
#: flipped by bfloat16 rounding between padded and unpadded rows is not what is checked here)
MODEL_CASES = (("default-v4", "default-v4", {"moe": "ep"}),
               ("default-moe tp", "default-moe", {"moe": "tp"}),
               ("default-moe ep", "default-moe", {"moe": "ep"}))
DRAFT_MODES = ("breakable", "full")
#: decode steps a path runs (the same fixed tokens on the graph and the eager path)
DECODE_STEPS = 4


def _engine(st: Settings, model, dtype: str, graph: str, attention: str, verify: bool, **extra) -> PrefillEngine:
    rt = RuntimeConfig(device=st.device, dtype=dtype, graph=graph, attention=attention, page_size=st.page_size,
                       kv_tokens=8 * st.engine_bucket + 8 * st.page_size, graph_backend=st.graph_backend,
                       max_requests=4, verify_capture=verify, **extra)
    return PrefillEngine(model, rt, None, BucketSet((st.engine_bucket,), padding_factor=64.0))


def _tokens(engine: PrefillEngine, st: Settings) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cached prefix, its extension and another request (the same on every path)."""
    rng = np.random.default_rng(st.seed + 7)
    return tuple(rng.integers(0, engine.cfg.vocab_size, n) for n in st.engine_batch)


def _prefill(engine: PrefillEngine, toks: tuple, eager: bool):
    """The prefix, then the batch extending it (graph path or eager); every handle released
    (the extension's handle is the prefix's sequence, grown)."""
    prefix, ext, other = toks
    h = engine.prefill([Request(prefix)]).handles[0]
    out = engine.prefill([Request(ext, h), Request(other)], force_eager=eager)
    for x in out.handles:
        engine.release(x)
    return out


def _judge_prefill(row: dict, graph, eager, dtype: str, what: str = "prefill") -> None:
    """The graph path's logits (``graph`` / ``eager``: the logits compared) are within the
    bound of the eager path's."""
    got, want = graph.float(), eager.float()
    diff = float((got - want).norm() / max(float(want.norm()), 1e-30))
    row.update(logits_rel_diff_vs_eager=diff, tol=RUN_TOLERANCE[dtype])
    if row["status"] == "pass" and not diff <= RUN_TOLERANCE[dtype]:
        row.update(status="fail", error=f"logits differ from the eager {what}'s: relative {diff:.3g} > "
                                        f"{RUN_TOLERANCE[dtype]:g}")


def check_model(engine: PrefillEngine, st: Settings, row: dict) -> None:
    """A model engine's row (module doc; graphcp.gpucheck.hybrid's rows start with it)."""
    stats = engine.capture()
    row["segments_breaks"] = {s.capacity: [s.segments, s.breaks] for s in stats}
    moe = [layer for layer in engine.parts.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    row["experts_in_break"] = bool(moe) and all(layer.exchanges for layer in moe)
    toks = _tokens(engine, st)
    h = engine.prefill([Request(toks[0])]).handles[0]
    try:
        row["batches"] = [compare_replay(engine, [Request(toks[1], h), Request(toks[2])],
                                         f"[{len(toks[0])}+{len(toks[1])}, {len(toks[2])}]")]
    finally:
        engine.release(h)
    judge_batches(row)
    graph, eager = _prefill(engine, toks, False), _prefill(engine, toks, True)
    row["ran"] = graph.info.path
    if graph.info.path != "graph" and row["status"] == "pass":
        row.update(status="fail", error=f"the prefill ran eagerly ({graph.info.fallback}): a graph was asked")
    _judge_prefill(row, graph.last_logits, eager.last_logits, row["dtype"])


def _check_draft(engine: PrefillEngine, st: Settings, row: dict) -> None:
    engine.capture()
    toks = _tokens(engine, st)
    batch = [toks[0], toks[2]]
    prep = engine.parts.preparer.prepare([Request(t) for t in batch])
    try:
        cap = engine.parts.runner.select(prep.plan.max_local_rows).capacity
        replayed = engine.parts.runner.try_replay(prep)
        if isinstance(replayed, Fallback):
            row["batches"] = [{"batch": "target", "status": "fallback", "error": replayed.reason}]
        else:
            ids = draft_input_ids(np.concatenate(batch), prep.plan.extend_lens, np.array([1, 2]),
                                  prep.plan.rank(engine.rank).rows)
            graphs = engine.parts.drafter.graphs
            want = [t.clone() for t in graphs.eager_on_bucket(prep, cap, ids)]
            got = graphs.replay(prep, cap, ids, {})
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
            row["batches"] = [{"batch": "draft", "bucket": cap, "bitwise_equal": same, "max_abs_diff": diff,
                               "status": "pass" if same else "fail"}]
    finally:
        engine.parts.preparer.abort(prep)
    judge_batches(row)
    outs = {}
    for eager in (False, True):
        out = engine.prefill([Request(t) for t in batch], force_eager=eager)
        outs[eager] = out
        for h in out.handles:
            engine.release(h)
    row["ran"] = outs[False].info.path
    if row["ran"] != "graph" and row["status"] == "pass":
        row.update(status="fail", error=f"the prefill ran eagerly ({outs[False].info.fallback}): a graph was asked")
    _judge_prefill(row, outs[False].draft.logits, outs[True].draft.logits, row["dtype"])


def decode_steps(engine: PrefillEngine, toks: tuple, tokens: np.ndarray, eager: bool) -> tuple[list, list, list]:
    """Prefill ``toks``, then one step a row of ``tokens``; each step's logits, info and
    wall time (every handle released)."""
    handles = engine.prefill([Request(t) for t in toks]).handles
    logits, infos, times = [], [], []
    try:
        for step_tokens in tokens:
            t0 = time.perf_counter()
            step = engine.decode(handles, step_tokens, force_eager=eager, logits=True)  # compared below
            times.append(time.perf_counter() - t0)
            handles = step.handles
            logits.append(step.logits)
            infos.append(step.info)
    finally:
        for h in handles:
            engine.release(h)
    return logits, infos, times


def check_decode(engine: PrefillEngine, st: Settings, row: dict) -> None:
    """A few steps of a batch on the decode graphs, the first replay of each bucket
    self-checked, then eagerly: the steps' logits within the run's bound (graphcp.gpucheck.hybrid's
    decode row too)."""
    toks = _tokens(engine, st)
    tokens = np.random.default_rng(st.seed + 11).integers(0, engine.cfg.vocab_size, (DECODE_STEPS, len(toks)))
    batch = {"batch": f"{len(toks)} requests x {DECODE_STEPS} steps"}
    try:
        graph, infos, graph_s = decode_steps(engine, toks, tokens, False)
    except CaptureError as e:  # the self-check of a first replay: a difference
        row["batches"] = [{**batch, "bitwise_equal": False, "status": "fail", "error": str(e)}]
        judge_batches(row)
        return
    checked = engine.parts.decoder.graphs.verified
    buckets = sorted({i.bucket for i in infos if i.bucket is not None})
    same = bool(buckets) and all(any(b == c for c, _ in checked) for b in buckets)
    row["batches"] = [{**batch, "bucket": buckets, "bitwise_equal": same, "status": "pass" if same else "fail"}]
    judge_batches(row)
    eager, _, eager_s = decode_steps(engine, toks, tokens, True)
    paths = {i.path for i in infos}
    row.update(ran="graph" if paths == {"graph"} else "eager", launches_per_step=infos[-1].stats.get("launches"),
               graph_step_ms=1e3 * float(np.median(graph_s[1:])), eager_step_ms=1e3 * float(np.median(eager_s[1:])))
    if row["ran"] != "graph" and row["status"] == "pass":
        fallbacks = sorted({str(i.fallback) for i in infos if i.path != "graph"})
        row.update(status="fail", error=f"a decode step ran eagerly ({', '.join(fallbacks)}): a graph was asked")
    _judge_prefill(row, torch.cat(graph), torch.cat(eager), row["dtype"], "decode")


def run_row(row: dict, budget: Budget, device: torch.device, build, check, st: Settings) -> None:
    """Build an engine and ``check(engine, st, row)`` it (graphcp.gpucheck.hybrid's rows too),
    unless the budget is spent; an error marks the row, the device memory is freed."""
    if not budget.allows(5.0):
        skip(row, TIME_BUDGET)
        return
    engine = None
    try:
        engine = build()
        check(engine, st, row)
        log(f"engine {row['engine']} {row['dtype']} {row['graph']}: {row['status']}"
            + (f" ({row.get('error')})" if row["status"] != "pass" else ""))
    except Exception as e:  # noqa: BLE001 - recorded, the next engine runs
        fail(row, f"engine {row['engine']} {row['graph']}", e)
    finally:
        del engine
        free_device_memory(device)


def check_engines(st: Settings, budget: Budget, available: list[str]) -> list[dict]:
    """One row per engine: the model engines (float32, breakable), the EAGLE-3 draft's
    graphs (the timing dtype, breakable and full; a full graph where Triton is available),
    then decode (the timing dtype, breakable)."""
    device = torch.device(st.device)
    rows: list[dict] = []
    attention = st.graph_attention["breakable"] if st.graph_attention["breakable"] in available else "torch"
    for label, preset, extra in MODEL_CASES:
        row = {"engine": label, "dtype": "float32", "graph": "breakable", "status": "pending", "batches": []}
        rows.append(row)

        def model(p: str = preset, x: dict = extra) -> PrefillEngine:  # V4 attends with its own reference
            return _engine(st, ensure_preset(p), "float32", "breakable", "torch" if p == "default-v4" else attention,
                           True, **x)

        run_row(row, budget, device, model, check_model, st)
    target = ensure_preset("default")
    draft: Path | None = None
    for mode in DRAFT_MODES:
        row = {"engine": "default + EAGLE-3 draft", "dtype": st.timing_dtype, "graph": mode, "status": "pending",
               "batches": []}
        rows.append(row)
        backend = st.graph_attention[mode]
        if backend not in available:
            skip(row, f"the {backend} backend is not available")
            continue
        draft = draft or ensure_random_draft(target, "default", st.seed)

        def build(m: str = mode, b: str = backend) -> PrefillEngine:  # (the graphs part self-checks the target)
            return _engine(st, target, st.timing_dtype, m, b, False, draft=str(draft))

        run_row(row, budget, device, build, _check_draft, st)
    row = {"engine": "default decode", "dtype": st.timing_dtype, "graph": "breakable", "status": "pending",
           "batches": []}
    rows.append(row)
    run_row(row, budget, device, lambda: _engine(st, target, st.timing_dtype, "breakable", attention, True),
            check_decode, st)
    return rows
