"""Launches per forward: host ops dispatched, and from a ``torch.profiler`` trace
(CUDA activity) the kernels, launch calls and graph launches; the Chrome trace,
with the graphcp ranges (the NVTX range names), is written next to the report
for the first model. Runs last: the profiler (CUPTI) attaching to CUDA graphs
is the riskiest step of a run, so nothing else waits behind it."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from graphcp.gpucheck.budget import Budget
from graphcp.gpucheck.common import TIME_BUDGET, fail, free_device_memory, log, skip, sync
from graphcp.gpucheck.settings import Settings
from graphcp.gpucheck.timing import ENGINE_PATHS, graph_units, one_prefill, open_engine, row, tokens_for
from graphcp.jobs.op_counter import OpCounter
from graphcp.jobs.quiet_profiler import without_kineto_log
from graphcp.nvtx_ranges import PREFIX, family
from graphcp.runtime.capture.buckets import align_up


def count_launches(fn: Callable[[], Any], device: torch.device, with_profiler: bool,
                   trace_path: Path | None = None) -> dict:
    """What one call of ``fn`` launches: host ops dispatched (a dispatch-mode
    counter; a graph replay dispatches none of its captured ops) and, with
    ``with_profiler``, a ``torch.profiler`` trace: on CUDA kernels executed,
    kernel-launch API calls and graph launches; everywhere the graphcp ranges
    it holds. ``trace_path``: keep the Chrome trace there (gzip)."""
    res: dict[str, Any] = {}
    with OpCounter() as c:
        fn()
    sync(device)
    res["host_ops"] = c.count
    if not with_profiler:
        return res
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        with without_kineto_log():
            with profile(activities=acts) as prof:
                fn()
                sync(device)
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


def count_paths(model_label: str, model_dir: Path, backend: str, st: Settings, budget: Budget,
                trace_dir: Path | None = None) -> list[dict]:
    """Launches per forward on each path at the smallest size (the count does not
    grow with the tokens), on engines holding that one bucket."""
    device = torch.device(st.device)
    n = min(st.sizes)
    caps = (int(align_up(n, 8)),)
    rows_all = []
    for graph, paths in ENGINE_PATHS.items():
        rows = {p: row(model_label, backend, p, n) for p in paths}
        rows_all.extend(rows.values())
        if not budget.allows(10.0):
            for r in rows.values():
                skip(r, TIME_BUDGET)
            continue
        engine = open_engine(model_label, model_dir, backend, graph, st, caps, list(rows.values()), None)
        if engine is None:
            continue
        tokens = tokens_for(st, n, engine.cfg.vocab_size)
        for p, r in rows.items():
            if not budget.allows(5.0):
                skip(r, TIME_BUDGET)
                continue
            prefill = one_prefill(engine, tokens, p)

            def forward(r=r, prefill=prefill, engine=engine) -> None:
                out = prefill()
                r["ran"] = out.info.path
                r.update(graph_units(engine, out))

            try:
                forward()  # warm (lazy init stays out of the count)
                trace = None if trace_dir is None else trace_dir / f"trace_{model_label}_{backend}_{p}.json.gz"
                r.update(count_launches(forward, device, st.profile, trace))
                r["status"] = "ok"
                if p != "eager" and r["ran"] != "graph":  # a graph was asked: its launches were not counted
                    r.update(status="fallback", error=f"ran {r['ran']}, not the {p} graph")
                log(f"{model_label}/{backend}/{p}: {r.get('kernels', '-')} kernels, {r['host_ops']} host ops")
            except Exception as e:  # noqa: BLE001 - recorded, the next path runs
                fail(r, f"{model_label}/{backend}/{p} launch count", e)
        del engine
        free_device_memory(device)
    return rows_all


def count_models(prepared: list[tuple[str, Path]], backends: list[str], st: Settings, budget: Budget,
                 out_dir: Path) -> list[dict]:
    """Launch rows of every prepared model and backend; traces of the first model only."""
    rows = []
    for i, (label, folder) in enumerate(prepared):
        for b in backends:
            rows.extend(count_paths(label, folder, b, st, budget, out_dir if i == 0 else None))
    return rows
