"""Eager vs breakable vs full-graph prefill at CP = 1, one request of each size.

Per path: warm-up, then the median of ``repeats`` synchronised
``engine.prefill`` calls (the whole prefill, a time-to-first-token proxy),
fewer when a row would take over ``item_cap_s``. Eager runs on the breakable
engine (``force_eager``); the full graph gets an engine of its own, where the
backend can run inside a graph.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from graphcp.config import RuntimeConfig
from graphcp.errors import ConfigError
from graphcp.gpucheck.budget import Budget
from graphcp.gpucheck.common import TIME_BUDGET, err, fail, free_device_memory, log, log_error, skip, sync
from graphcp.gpucheck.settings import LARGE_MODEL, Settings
from graphcp.jobs.tolerance import RUN_TOLERANCE
from graphcp.model.presets import PRESETS, ensure_preset, ensure_random_model
from graphcp.runtime.batch import PrefillOutput, Request
from graphcp.runtime.capture.buckets import BucketSet, align_up
from graphcp.runtime.engine import PrefillEngine

PATHS = ("eager", "breakable", "full")
#: graph mode of each engine -> the paths timed on it (eager runs on the breakable engine)
ENGINE_PATHS = {"breakable": ("eager", "breakable"), "full": ("full",)}


def prepare_model(name: str, layers: int | None) -> tuple[Path, str]:
    """Checkpoint folder of preset ``name`` (written once, random weights), with
    ``num_hidden_layers`` cut to ``layers`` when given (its own cache folder)."""
    if layers is None or layers == PRESETS[name]["num_hidden_layers"]:
        return ensure_preset(name), name
    label = f"{name}-{layers}l"
    return ensure_random_model(label, dict(PRESETS[name], num_hidden_layers=layers)), label


def row(model: str, backend: str, path: str, tokens: int) -> dict:
    return {"model": model, "backend": backend, "path": path, "tokens": tokens, "status": "pending"}


def tokens_for(st: Settings, n: int, vocab: int) -> np.ndarray:
    """The batch of ``n`` new tokens: the same on every path, so logits compare."""
    return np.random.default_rng(st.seed + n).integers(0, vocab, n)


def one_prefill(engine: PrefillEngine, tokens: np.ndarray, path: str) -> Callable[[], PrefillOutput]:
    """A prefill of one request on ``path`` that releases its KV afterwards."""
    def forward() -> PrefillOutput:
        out = engine.prefill([Request(tokens)], force_eager=path == "eager")
        for h in out.handles:
            engine.release(h)
        return out

    return forward


def graph_units(engine: PrefillEngine, out: PrefillOutput) -> dict:
    """Segments and breaks of the graph a forward replayed (nothing when it ran eagerly)."""
    if out.info.path != "graph":
        return {}
    g = engine.parts.runner.graphs[out.info.capacity].graph
    return {"segments": len(g.segments), "breaks": len(g.breaks)}


def _measure(engine: PrefillEngine, tokens: np.ndarray, path: str, st: Settings, budget: Budget, r: dict) -> Any:
    """Warm up, then time ``st.repeats`` prefills (fewer when they would not fit
    ``st.item_cap_s`` or the budget). Returns the last output."""
    device = engine.device
    forward = one_prefill(engine, tokens, path)
    warm = []
    for _ in range(max(1, st.warmup)):
        sync(device)
        t0 = time.perf_counter()
        out = forward()
        sync(device)
        warm.append(time.perf_counter() - t0)
        if warm[-1] * 3 > budget.remaining():
            break
    per = warm[-1]
    reps = max(1, min(st.repeats, int(st.item_cap_s / max(per, 1e-6)), int(budget.remaining() / max(per, 1e-6))))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        out = forward()
        sync(device)
        times.append(time.perf_counter() - t0)
    info = out.info
    r.update(
        status="ok", median_ms=1e3 * float(np.median(times)), min_ms=1e3 * min(times), repeats=reps,
        warmup_ms=[round(1e3 * w, 3) for w in warm], times_ms=[round(1e3 * t, 3) for t in times],
        tokens_per_s=len(tokens) / float(np.median(times)), ran=info.path, bucket=info.capacity if info.path == "graph"
        else None, fallback=info.fallback,
        host_timings_ms={k: round(1e3 * v, 3) for k, v in info.timings.items()},
    )
    if device.type == "cuda":
        r["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated(device))
    if path != "eager" and info.path != "graph":
        r["status"] = "fallback"
        r["error"] = f"ran eagerly: {info.fallback}"
    r.update(graph_units(engine, out) if path != "eager" else {})
    return out


def judge_logits(r: dict, got: torch.Tensor, eager: torch.Tensor, dtype: str) -> None:
    """A graph path's last logits against the eager path's, within the bound graphcp run
    and the CPU tests use (graphcp.jobs.tolerance): otherwise the row fails."""
    diff = float((got - eager).norm() / max(float(eager.norm()), 1e-30))
    tol = RUN_TOLERANCE[dtype]
    r.update(logits_rel_diff_vs_eager=diff, tol=tol)
    if r["status"] == "ok" and not diff <= tol:
        r.update(status="fail", error=f"logits differ from the eager path's: relative {diff:.3g} > {tol:g}")


def open_engine(model_label: str, model_dir: Path, backend: str, graph: str, st: Settings, caps: tuple[int, ...],
                rows: list[dict], captures: list[dict] | None) -> PrefillEngine | None:
    """Build and capture an engine; on failure mark ``rows`` (skipped when the
    backend cannot run a full graph, error otherwise) and return None. The graph
    check verifies captures; timing engines leave the self-check out of capture time."""
    device = torch.device(st.device)
    engine = None
    try:
        t0 = time.perf_counter()
        rt = RuntimeConfig(device=st.device, dtype=st.timing_dtype, graph=graph, attention=backend,
                           kv_tokens=max(caps) + 4 * st.page_size, page_size=st.page_size,
                           graph_backend=st.graph_backend, max_requests=4, verify_capture=False)
        engine = PrefillEngine(model_dir, rt, None, BucketSet(caps))
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        stats = engine.capture()
        log(f"{model_label}/{backend}/{graph}: engine {build_s:.1f} s, captured {len(stats)} bucket(s) in "
            f"{time.perf_counter() - t0:.1f} s")
        for s in stats if captures is not None else ():
            captures.append({"model": model_label, "backend": backend, "graph": graph, "capacity": s.capacity,
                             "capture_s": s.capture_s, "pool_bytes": s.pool_bytes, "segments": s.segments,
                             "breaks": s.breaks})
        return engine
    except Exception as e:  # noqa: BLE001
        unsupported = isinstance(e, ConfigError) and graph == "full"
        for r in rows:
            if unsupported:
                skip(r, f"not supported: {backend} attention cannot run inside a full graph")
            else:
                r.update(status="error", error=err(e))
        if not unsupported:
            log_error(f"{model_label}/{backend}/{graph}", e)
        del engine
        free_device_memory(device)
        return None


def time_paths(model_label: str, model_dir: Path, backend: str, st: Settings, budget: Budget) -> dict:
    """Eager, breakable and (where supported) full-graph prefill of one request
    of each size: timing rows and capture stats."""
    device = torch.device(st.device)
    out: dict[str, list] = {"timing": [], "captures": []}
    sizes = list(st.sizes)
    caps = tuple(sorted({int(align_up(s, 8)) for s in sizes}))
    eager_logits: dict[int, torch.Tensor] = {}
    for graph, paths in ENGINE_PATHS.items():
        rows = {(p, n): row(model_label, backend, p, n) for p in paths for n in sizes}
        out["timing"].extend(rows.values())
        if not budget.allows(10.0):
            for r in rows.values():
                skip(r, TIME_BUDGET)
            continue
        engine = open_engine(model_label, model_dir, backend, graph, st, caps, list(rows.values()), out["captures"])
        if engine is None:
            continue
        for n in sizes:
            tokens = tokens_for(st, n, engine.cfg.vocab_size)
            for p in paths:
                r = rows[(p, n)]
                if not budget.allows(2.0):
                    skip(r, TIME_BUDGET)
                    continue
                try:
                    res = _measure(engine, tokens, p, st, budget, r)
                    last = res.last_logits.float()
                    if p == "eager":
                        eager_logits[n] = last
                    elif n in eager_logits:
                        judge_logits(r, last, eager_logits[n], st.timing_dtype)
                    log(f"{model_label}/{backend}/{p} {n} tokens: {r['median_ms']:.2f} ms (n={r['repeats']}, "
                        f"ran {r['ran']})")
                except Exception as e:  # noqa: BLE001 - recorded, the next row runs
                    fail(r, f"{model_label}/{backend}/{p} {n}", e)
        del engine
        free_device_memory(device)
    return out


def time_models(st: Settings, budget: Budget, backends: list[str], res: dict, save: Callable[[], Any],
                prepared: list[tuple[str, Path]]) -> None:
    """Write (once) and time every model of the settings with each backend: rows into
    ``res`` ("models", "timing", "captures", "errors"), saved after each; the (label,
    folder) of each model written goes to ``prepared`` as soon as it is ready."""
    for model in st.models:
        try:
            if not budget.allows(20.0):
                raise TimeoutError(TIME_BUDGET)
            folder, label = prepare_model(model, st.large_layers if model == LARGE_MODEL else None)
            res["models"][label] = {"preset": model, "dir": str(folder),
                                    "config": json.loads((folder / "config.json").read_text())}
        except Exception as e:  # noqa: BLE001
            status = "skipped" if isinstance(e, TimeoutError) else "error"
            res["timing"] += [{**row(model, b, p, n), "status": status,
                               "error": TIME_BUDGET if status == "skipped" else err(e)}
                              for b in backends for p in PATHS for n in st.sizes]
            if status == "error":
                res["errors"].append(f"model {model}: {err(e)}")
            continue
        prepared.append((label, folder))
        for b in backends:
            got = time_paths(label, folder, b, st, budget)
            for k in ("timing", "captures"):
                res[k].extend(got[k])
            save()
