"""Eager vs breakable vs full-graph prefill at CP = 1 (one request of each size),
and launches per forward from a ``torch.profiler`` trace (CUDA activity) whose
Chrome trace, with the graphcp ranges (the NVTX range names), is written next
to the report for the first model.

Per path: warm-up, then the median of ``repeats`` synchronised
``engine.prefill`` calls (the whole prefill, a time-to-first-token proxy),
fewer when a row would take over ``item_cap_s``. Eager runs on the breakable
engine (``force_eager``); the full graph gets an engine of its own, where the
backend can run inside a graph.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from gpucheck.common import LARGE_MODEL, Budget, Settings, err, free_device_memory, log, sync
from gpucheck.kernels import skip

PATHS = ("eager", "breakable", "full")


def prepare_model(name: str, layers: int | None) -> tuple[Path, str]:
    """Checkpoint folder of preset ``name`` (written once, random weights), with
    ``num_hidden_layers`` cut to ``layers`` when given (its own cache folder)."""
    from graphcp.model.presets import PRESETS, cache_root, ensure_preset, random_weights

    if layers is None or layers == PRESETS[name]["num_hidden_layers"]:
        return ensure_preset(name), name
    label = f"{name}-{layers}l"
    folder = cache_root() / "models" / label
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder, label
    from safetensors.torch import save_file

    config = dict(PRESETS[name], num_hidden_layers=layers)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{label}-", dir=folder.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(random_weights(config), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder, label


def count_launches(fn: Callable[[], Any], device: torch.device, profile: bool, trace_path: Path | None = None) -> dict:
    """What one call of ``fn`` launches: host ops dispatched (a dispatch-mode
    counter; a graph replay dispatches none of its captured ops) and, with
    ``profile``, a ``torch.profiler`` trace: on CUDA kernels executed,
    kernel-launch API calls and graph launches; everywhere the graphcp ranges
    it holds. ``trace_path``: keep the Chrome trace there (gzip)."""
    from graphcp.cli.jobs import OpCounter

    res: dict[str, Any] = {}
    with OpCounter() as c:
        fn()
    sync(device)
    res["host_ops"] = c.count
    if not profile:
        return res
    from torch.profiler import ProfilerActivity, profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tempfile.TemporaryDirectory() as tmp:
        with tprofile(activities=acts) as prof:
            fn()
            sync(device)
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
        if trace_path is not None:
            trace_path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "rb") as src, gzip.open(trace_path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            res["trace"] = trace_path.name
    res.update(trace_counts(events, device.type == "cuda"))
    res["ranges"] = range_counts(events)
    return res


def range_counts(events: list[dict]) -> dict[str, int]:
    """graphcp ranges (``graphcp:<name>`` events, the NVTX range names) per family."""
    from graphcp.profile.ranges import PREFIX, family

    out: dict[str, int] = {}
    for ev in events:
        name = ev.get("name", "")
        if ev.get("ph") == "X" and name.startswith(PREFIX):
            fam = family(name[len(PREFIX):])
            out[fam] = out.get(fam, 0) + 1
    return dict(sorted(out.items()))


def trace_counts(events: list[dict], cuda: bool) -> dict:
    """Counts from a chrome trace: kernels, launch calls, graph launches, copies."""
    cats: dict[str, int] = {}
    launch_calls = graph_launches = 0
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        cats[cat] = cats.get(cat, 0) + 1
        if cat in ("cuda_runtime", "cuda_driver"):
            name = ev.get("name", "")
            if "GraphLaunch" in name:
                graph_launches += 1
            elif "LaunchKernel" in name or "LaunchCooperativeKernel" in name:
                launch_calls += 1
    if not cuda:
        return {"profiled_cpu_ops": cats.get("cpu_op", 0)}
    return {
        "kernels": cats.get("kernel", 0),
        "kernel_launch_calls": launch_calls,
        "graph_launches": graph_launches,
        "memcpy": cats.get("gpu_memcpy", 0),
        "memset": cats.get("gpu_memset", 0),
    }


def _row(model: str, backend: str, path: str, tokens: int, **kw) -> dict:
    return {"model": model, "backend": backend, "path": path, "tokens": tokens, "status": "pending", **kw}


def _measure(engine, tokens: np.ndarray, path: str, st: Settings, budget: Budget, row: dict) -> Any:
    """Warm up, then time ``st.repeats`` prefills (fewer when they would not fit
    ``st.item_cap_s`` or the budget). Returns the last output."""
    from graphcp import Request

    device = engine.device
    force_eager = path == "eager"

    def forward():
        out = engine.prefill([Request(tokens)], force_eager=force_eager)
        for h in out.handles:
            engine.release(h)
        return out

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
    row.update(
        status="ok", median_ms=1e3 * float(np.median(times)), min_ms=1e3 * min(times), repeats=reps,
        warmup_ms=[round(1e3 * w, 3) for w in warm], times_ms=[round(1e3 * t, 3) for t in times],
        tokens_per_s=len(tokens) / float(np.median(times)), ran=info.path, bucket=info.capacity if info.path == "graph"
        else None, fallback=info.fallback,
        host_timings_ms={k: round(1e3 * v, 3) for k, v in info.timings.items()},
    )
    if device.type == "cuda":
        row["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated(device))
    if path != "eager" and info.path != "graph":
        row["status"] = "fallback"
        row["error"] = f"ran eagerly: {info.fallback}"
    if path != "eager" and info.path == "graph":
        g = engine.runner.graphs[info.capacity].graph
        row.update(segments=len(g.segments), breaks=len(g.breaks))
    return out


def _engine(model_dir: Path, backend: str, graph: str, st: Settings, kv_tokens: int, caps: tuple[int, ...]):
    from graphcp.capture.buckets import BucketSet
    from graphcp.config import RuntimeConfig
    from graphcp.engine import PrefillEngine
    from gpucheck.graphs import has_capture_self_check

    # the graph check verifies captures; timing engines leave the self-check out of capture time
    kw = dict(verify_capture=False) if has_capture_self_check() else {}
    rt = RuntimeConfig(device=st.device, dtype=st.timing_dtype, graph=graph, attention=backend,
                       kv_tokens=kv_tokens, page_size=st.page_size, graph_backend=st.graph_backend, max_requests=4,
                       **kw)
    return PrefillEngine(model_dir, rt, None, BucketSet(caps))


def _graph_modes(backend: str) -> tuple[str, ...]:
    return ("breakable", "full")


def _open_engine(model_label: str, model_dir: Path, backend: str, graph: str, st: Settings, caps: tuple[int, ...],
                 rows: list[dict], captures: list[dict] | None):
    """Build and capture an engine; on failure mark ``rows`` (skipped when the
    backend cannot run a full graph, error otherwise) and return None."""
    from graphcp.config import ConfigError

    device = torch.device(st.device)
    engine = None
    try:
        t0 = time.perf_counter()
        engine = _engine(model_dir, backend, graph, st, max(caps) + 4 * st.page_size, caps)
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
            log(f"{model_label}/{backend}/{graph}: ERROR {err(e)}")
            log("".join(traceback.format_exception(e)[-3:]).rstrip())
        del engine
        free_device_memory(device)
        return None


def _tokens(st: Settings, n: int, vocab: int) -> np.ndarray:
    """The batch of ``n`` new tokens: the same on every path, so logits compare."""
    return np.random.default_rng(st.seed + n).integers(0, vocab, n)


def time_paths(model_label: str, model_dir: Path, backend: str, st: Settings, budget: Budget) -> dict:
    """Eager, breakable and (where supported) full-graph prefill of one request
    of each size: timing rows and capture stats. Eager runs on the breakable
    engine (``force_eager``); the full graph gets an engine of its own."""
    from graphcp.capture.buckets import align_up

    device = torch.device(st.device)
    out: dict[str, list] = {"timing": [], "captures": []}
    sizes = list(st.sizes)
    caps = tuple(sorted({int(align_up(s, 8)) for s in sizes}))
    eager_logits: dict[int, torch.Tensor] = {}
    for graph in _graph_modes(backend):
        paths = ("eager", "breakable") if graph == "breakable" else ("full",)
        rows = {(p, n): _row(model_label, backend, p, n) for p in paths for n in sizes}
        out["timing"].extend(rows.values())
        if not budget.allows(10.0):
            for r in rows.values():
                skip(r, "time budget")
            continue
        engine = _open_engine(model_label, model_dir, backend, graph, st, caps, list(rows.values()), out["captures"])
        if engine is None:
            continue
        for n in sizes:
            tokens = _tokens(st, n, engine.cfg.vocab_size)
            for p in paths:
                r = rows[(p, n)]
                if not budget.allows(2.0):
                    skip(r, "time budget")
                    continue
                try:
                    res = _measure(engine, tokens, p, st, budget, r)
                    last = res.last_logits.float()
                    if p == "eager":
                        eager_logits[n] = last
                    elif n in eager_logits:
                        ref = eager_logits[n]
                        r["logits_rel_diff_vs_eager"] = float((last - ref).norm() / max(float(ref.norm()), 1e-30))
                    log(f"{model_label}/{backend}/{p} {n} tokens: {r['median_ms']:.2f} ms (n={r['repeats']}, "
                        f"ran {r['ran']})")
                except Exception as e:  # noqa: BLE001
                    r.update(status="error", error=err(e))
                    log(f"{model_label}/{backend}/{p} {n}: ERROR {err(e)}")
                    log("".join(traceback.format_exception(e)[-3:]).rstrip())
        del engine
        free_device_memory(device)
    return out


def count_paths(model_label: str, model_dir: Path, backend: str, st: Settings, budget: Budget,
                trace_dir: Path | None = None) -> list[dict]:
    """Launches per forward on each path at the smallest size (the count does not
    grow with the tokens), on engines holding that one bucket. Runs after all
    the timing: the profiler (CUPTI) attaching to CUDA graphs is the riskiest
    step of the run, so nothing else waits behind it."""
    from graphcp.capture.buckets import align_up
    from graphcp import Request

    device = torch.device(st.device)
    n = min(st.sizes)
    caps = (int(align_up(n, 8)),)
    rows_all = []
    for graph in _graph_modes(backend):
        paths = ("eager", "breakable") if graph == "breakable" else ("full",)
        rows = {p: _row(model_label, backend, p, n) for p in paths}
        rows_all.extend(rows.values())
        if not budget.allows(10.0):
            for r in rows.values():
                skip(r, "time budget")
            continue
        engine = _open_engine(model_label, model_dir, backend, graph, st, caps, list(rows.values()), None)
        if engine is None:
            continue
        tokens = _tokens(st, n, engine.cfg.vocab_size)
        for p, r in rows.items():
            if not budget.allows(5.0):
                skip(r, "time budget")
                continue

            def forward(p=p, r=r):
                o = engine.prefill([Request(tokens)], force_eager=p == "eager")
                for h in o.handles:
                    engine.release(h)
                r["ran"] = o.info.path
                if o.info.path == "graph":
                    g = engine.runner.graphs[o.info.capacity].graph
                    r.update(segments=len(g.segments), breaks=len(g.breaks))

            try:
                forward()  # warm (lazy init stays out of the count)
                trace = None if trace_dir is None else trace_dir / f"trace_{model_label}_{backend}_{p}.json.gz"
                r.update(count_launches(forward, device, st.profile, trace))
                r["status"] = "ok"
                log(f"{model_label}/{backend}/{p}: {r.get('kernels', '-')} kernels, {r['host_ops']} host ops")
            except Exception as e:  # noqa: BLE001
                r.update(status="error", error=err(e))
                log(f"{model_label}/{backend}/{p}: launch count ERROR {err(e)}")
        del engine
        free_device_memory(device)
    return rows_all
