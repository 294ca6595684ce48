"""The jobs behind ``graphcp prefill`` and ``graphcp run``, written as per-rank functions
``fn(group, spec, ...)`` so they run the same under ``torchrun`` and under graphcp's own
launcher (:mod:`graphcp.jobs.spec`)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphcp.attention.exchange import exchanged_row_bytes_per_layer
from graphcp.cli.requests import FileRequest
from graphcp.dist import CPGroup, barrier, gather_object
from graphcp.jobs.op_counter import OpCounter
from graphcp.jobs.spec import JobSpec, make_engine
from graphcp.pd.files import save_kv
from graphcp.runtime.batch import PrefillOutput, Request
from graphcp.runtime.engine import PrefillEngine, prefill_after_prefixes
from graphcp.runtime.pp.microbatch import split_microbatches


def prefill_requests(engine: PrefillEngine, reqs: list[FileRequest], all_logits: bool) -> PrefillOutput:
    """Prefill cached prefixes first (one forward), then every request's new tokens."""
    return prefill_after_prefixes(
        engine, [(np.asarray(r.tokens[: r.prefix]) if r.prefix else None, np.asarray(r.new_tokens)) for r in reqs],
        all_logits)


def export_files(engine: PrefillEngine, out: PrefillOutput, reqs: list[FileRequest], staging: str | Path) -> None:
    """``staging/<i>.safetensors`` for request i (graphcp.pd.files), written by global
    rank 0, which makes the folder; every rank of every stage takes part (a layer-split
    cache sends each layer from its owner, pipeline stages their own layers), and a last
    collective says every rank's part is in. ``graphcp prefill`` names ``staging`` beside
    ``--export-kv`` and moves the files into it once the run has succeeded (with its
    other outputs: graphcp/cli/commands.py), removing ``staging`` whatever happens: a
    failure or a Ctrl-C leaves ``--export-kv`` as it was."""
    staging = Path(staging)
    first = engine.world_rank == 0
    if first:
        staging.mkdir()
    for i, (r, h) in enumerate(zip(reqs, out.handles)):
        export = engine.export_kv(h, dst=0)
        if export is not None:
            export.token_ids = torch.tensor(r.tokens, dtype=torch.int64)
            export.last_logits = out.last_logits[i]
            save_kv(export, staging / f"{i}.safetensors")
    barrier(engine.world)  # every rank's part is in: no rank failed after rank 0 wrote


def prefill_job(group: CPGroup, spec: JobSpec, reqs: list[FileRequest], all_logits: bool,
                with_stats: bool = False, export_staging: str | None = None) -> dict | None:
    engine = make_engine(group, spec)
    out = prefill_requests(engine, reqs, all_logits)
    if export_staging is not None:
        export_files(engine, out, reqs, export_staging)
    ranks = gather_object(group, engine.stats()) if with_stats else None  # every rank takes part
    stats = gather_object(group, dict(out.info.stats))  # every rank's figures (the indexer's work, say)
    if group.rank != 0:  # every rank holds the same outputs (under PP too: broadcast from their stages)
        return None
    result: dict[str, Any] = {"last_logits": out.last_logits.float().contiguous()}
    if all_logits:
        result["logits"] = [x.float().contiguous() for x in out.logits]
    if out.aux_hidden is not None:
        result["aux_hidden"] = [x.contiguous() for x in out.aux_hidden]
        result["aux_hidden_layers"] = list(spec.runtime.aux_hidden_layers)
    if out.draft is not None:  # an EAGLE-3 draft: its logits at each request's last position, its vocabulary map
        result["draft_logits"] = out.draft.logits.float().contiguous()
        result["draft_to_target"] = out.draft.draft_to_target.to(torch.int64).contiguous()
    result["info"] = {"path": out.info.path, "capacity": out.info.capacity, "fallback": out.info.fallback,
                      "cp_size": spec.cp_size, "pp_size": spec.pp_size, "layout": spec.runtime.layout,
                      "tp_size": spec.parallel.tp_size, "dp_size": spec.dp_size,
                      "graph": spec.runtime.graph,
                      "kv_cache": spec.runtime.kv_cache, "exchange": out.info.stats.get("exchange"),
                      "stats_per_rank": stats}
    if ranks is not None:
        result["stats"] = ranks
    return result


#: the `graphcp run` batch's request lengths: a long request, medium ones, one shorter than 2C, one single token
MIXED_LENGTHS = (1536, 640, 300, 97, 3, 1)
#: how much shorter its long requests are where attention runs in Triton's CPU interpreter
#: (about 1000 times slower than the torch reference: the whole batch would take hours)
INTERPRETER_SCALE = 32


def mixed_batch(vocab: int, seed: int = 0, scale: int = 1) -> list[np.ndarray]:
    """The `graphcp run` batch (``scale``: its requests longer than 3 tokens ``scale``
    times shorter)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n if n <= 3 else max(4, n // scale)) for n in MIXED_LENGTHS]


def interpreted(spec: JobSpec) -> bool:
    """Whether the run's attention is Triton's kernel in its CPU interpreter."""
    return spec.runtime.attention == "triton" and spec.runtime.device == "cpu"


def batch_capacity(engine: PrefillEngine, batch: list[np.ndarray]) -> int:
    """The bucket the batch's (first micro-batch's) forward selects."""
    first = split_microbatches([len(t) for t in batch], engine.runtime.microbatches)[0]
    prep = engine.parts.preparer.prepare([Request(batch[p.request][p.start:p.stop]) for p in first])
    try:
        return engine.parts.runner.select(prep.plan.max_local_rows).capacity
    finally:
        engine.parts.preparer.abort(prep)


def compare_paths(engine: PrefillEngine, batch: list[np.ndarray]) -> dict:
    """The batch on the graph path against eager: the replay against the same body run
    eagerly on the same bucket (must be bitwise equal), and the logits against the
    unpadded eager forward (equal within the rounding of matmuls over padded rows)."""
    reqs = [Request(t) for t in batch]
    runner = engine.parts.runner
    # the bucket check on what one forward of the body runs: the first micro-batch
    first = split_microbatches([len(t) for t in batch], engine.runtime.microbatches)[0]
    prep = engine.parts.preparer.prepare([Request(batch[p.request][p.start:p.stop]) for p in first])
    try:
        sel = runner.select(prep.plan.max_local_rows)
        bitwise = None
        if sel.graph:
            if sel.capacity not in runner.graphs:
                runner.capture_bucket(sel.capacity)
            # a later pipeline stage's body: seeded input rows, the same for both runs
            rows = runner.prefill.synthetic_input(prep, np.random.default_rng(0))
            same_bucket = runner.eager_on_bucket(prep, sel.capacity, rows).clone()
            bitwise = bool(torch.equal(runner.replay(prep, sel.capacity, hidden_in=rows), same_bucket))
            if engine.parts.pipeline is not None:  # every stage's body must be bitwise equal
                bitwise = all(gather_object(engine.parts.pipeline.world, bitwise))
    finally:
        engine.parts.preparer.abort(prep)
    outs = {}
    for path in ("graph", "eager"):
        outs[path] = engine.prefill(reqs, force_eager=path == "eager")
        for h in outs[path].handles:
            engine.release(h)
    g, e = outs["graph"].last_logits, outs["eager"].last_logits
    return {"dtype": engine.runtime.dtype, "path": outs["graph"].info.path, "bucket": outs["graph"].info.capacity,
            "same_bucket_bitwise": bitwise, "max_abs_diff": float((g - e).abs().max()),
            "rel_diff": float((g - e).norm() / e.norm())}


def twin_dtype(dtype: str) -> str:
    """The float dtype `graphcp run` compares the graph path in besides ``dtype``."""
    return "bfloat16" if dtype != "bfloat16" else "float32"


def run_job(group: CPGroup, spec: JobSpec, repeats: int = 3) -> dict | None:
    """`graphcp run`: capture the buckets, run a mixed batch on the graph path and
    eagerly, compare, and time both; then the same comparison in the other float
    dtype (float32 and bfloat16 round differently, and a replay bug can hide in one).
    In Triton's CPU interpreter: a batch ``INTERPRETER_SCALE`` times shorter, only the
    buckets up to the one it uses, timed once."""
    engine = make_engine(group, spec)
    small = interpreted(spec)
    batch = mixed_batch(engine.cfg.vocab_size, scale=INTERPRETER_SCALE if small else 1)
    repeats = 1 if small else repeats
    t0 = time.perf_counter()
    captures = []
    if engine.parts.runner is not None:
        up_to = batch_capacity(engine, batch) if small else None
        captures = engine.capture(progress=group.rank == 0, up_to=up_to)
    capture_s = time.perf_counter() - t0

    stored: dict[str, int] = {}

    def forward(force_eager: bool):
        out = engine.prefill([Request(t) for t in batch], force_eager=force_eager)
        stored[out.info.path] = engine.parts.kv.stored_tokens()  # the batch's KV on this rank, before release
        for h in out.handles:
            engine.release(h)
        return out

    timings: dict[str, list[float]] = {"graph": [], "eager": []}
    outs = {}
    for _ in range(repeats):
        for path in ("eager", "graph") if engine.parts.runner is not None else ("eager",):
            t = time.perf_counter()
            outs[path] = forward(path == "eager")
            timings[path].append(time.perf_counter() - t)
    ops = {}
    for path in outs:
        with OpCounter() as c:
            forward(path == "eager")
        ops[path] = c.count
    comparisons = []
    if engine.parts.runner is not None:
        comparisons.append(compare_paths(engine, batch))
        twin = make_engine(group, spec, replace(spec.runtime, dtype=twin_dtype(spec.runtime.dtype)))
        comparisons.append(compare_paths(twin, batch))
    stored_per_rank = gather_object(group, stored)  # every rank takes part
    stats = gather_object(group, dict(outs["eager"].info.stats))  # every rank's figures (the indexer's work, say)
    if group.rank != 0:
        return None
    res = {
        "model": str(engine.model_dir), "cp_size": spec.cp_size, "pp_size": spec.pp_size,
        "tp_size": spec.parallel.tp_size, "dp_size": spec.dp_size,
        "layout": spec.runtime.layout,
        "kv_cache": spec.runtime.kv_cache,
        "kv_stored_per_rank": [s.get("graph", s.get("eager")) for s in stored_per_rank],
        "graph": spec.runtime.graph, "attention": engine.parts.body.attention.name, "dtype": spec.runtime.dtype,
        "tokens": int(sum(len(t) for t in batch)), "requests": len(batch),
        "buckets": [c.capacity for c in captures], "capture_s": capture_s,
        "verify_s": sum(c.verify_s or 0.0 for c in captures),
        "captures": [vars(c) for c in captures],
        "eager_s": float(np.median(timings["eager"])), "ops_eager": ops["eager"],
        "comparisons": comparisons,
        # the per-forward figures (ForwardInfo.stats) of the graph forward, or the eager one
        "stats": outs["graph" if "graph" in outs else "eager"].info.stats,
        "stats_per_rank": stats,  # every rank's figures of the eager forward (the DSA indexer's work)
    }
    if "graph" in outs:
        parts, info = engine.parts, outs["graph"].info
        graph = parts.runner.graphs[info.capacity].graph if info.path == "graph" else None
        layers = parts.model.stage.layers  # a layer's rows on average (V4's differ by layer kind)
        values = sum(parts.kv.token_values(i) for i in layers) // len(layers)
        res["kv_bytes_per_layer"] = exchanged_row_bytes_per_layer(
            outs["graph"].info.capacity, spec.cp_size, values, engine.dtype.itemsize)
        st = outs["graph"].info.stats
        res.update(exchange=st["exchange"], bytes_received_per_layer=st["bytes_received_per_layer"],
                   exchange_reason=st.get("exchange_choice", {}).get("reason"))
        res.update(
            graph_s=float(np.median(timings["graph"])), ops_graph=ops["graph"],
            graph_segments=len(graph.segments) if graph else 0, graph_breaks=len(graph.breaks) if graph else 0,
            graph_path=outs["graph"].info.path, bucket=outs["graph"].info.capacity,
            max_abs_diff=comparisons[0]["max_abs_diff"], rel_diff=comparisons[0]["rel_diff"],
        )
    return res
