"""One GPU-check run: the parts in order, each inside its share of the budget,
the report rewritten after every part (a run that dies leaves what it had)."""

from __future__ import annotations

import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from graphcp.attention.registry import available_backends
from graphcp.gpucheck import engines, graphs, host, hybrid, kernels, launches, moe_graph, sparse_mla, timing
from graphcp.gpucheck.budget import Budget
from graphcp.gpucheck.common import FLASHINFER_ABSENT, device_info, env_info, err, log
from graphcp.gpucheck.report import JSON_NAME, MD_NAME, SCHEMA_VERSION, failures, write_report
from graphcp.gpucheck.settings import DRY_RESERVE_S, RESERVE_S, Settings, model_heads


def _notes(env: dict) -> list[str]:
    notes = [] if env["flashinfer_importable"] else [FLASHINFER_ABSENT]
    if not env["nvtx"]:
        notes.append("the nvtx package is missing: graphcp's ranges reach torch.profiler (the traces here) but "
                     "not NVTX/nsys")
    if not env["host_kernels_compiled"]:
        notes.append("numba is missing: graphcp's host kernels ran as their numpy twins and Python (the same "
                     "results; the host times here are not the compiled path's)")
    return notes


def _results(st: Settings, budget: Budget, budget_s: float, available: list[str], options: dict) -> dict[str, Any]:
    env = env_info()
    return {
        "schema": SCHEMA_VERSION, "dry_run": st.dry_run,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": 0.0, "budget_s": budget_s, "device": device_info(torch.device(st.device)), "env": env,
        "notes": _notes(env), "settings": dict(vars(st)), "options": options,
        "phases": {"shares": {k: round(v, 1) for k, v in budget.phases.items()}, "used": budget.used},
        "triton_warmup": None, "backends": {"available": available, "checked": available, "checks": []},
        "graphs": [], "engines": [], "hybrid": [], "host": [], "models": {}, "timing": [], "launches": [],
        "captures": [], "sparse_mla": [], "moe_graph": [], "errors": [], "failed_parts": [], "not_run": [],
    }


def run_check(st: Settings, out_dir: Path, budget_s: float, skip: set[str], options: dict,
              no_triton: bool = False, budget: Budget | None = None) -> tuple[str, list[str]]:
    """Run every part not in ``skip``; write ``gpu_check.json`` and ``gpu_check.md``
    into ``out_dir``; return the Markdown and what failed (:func:`failures`: empty when
    every part ran clean). ``no_triton``: leave Triton out (dry run); ``budget``: the
    clock's budget (tests pass one with a fake clock)."""
    budget = budget or Budget(budget_s, st.phases, reserve_s=DRY_RESERVE_S if st.dry_run else RESERVE_S)
    available = available_backends(torch.device(st.device))
    if no_triton and "triton" in available:
        available.remove("triton")
    res = _results(st, budget, budget_s, available, options)
    for n in res["notes"]:
        log(n)

    def save() -> str:
        res["elapsed_s"] = round(budget.elapsed(), 2)
        return write_report(res, out_dir)

    def part(name: str, fn: Callable[[], None], needs: str | None = None) -> None:
        if name in skip:
            return
        if needs is not None and needs not in available:
            why = f"the {needs} backend is not available"
            if no_triton:  # chosen away (--no-triton): noted, not a failure
                res["errors"].append(f"{name}: skipped, {why}")
            else:  # a required part that cannot run here: a failure
                res["not_run"].append((name, why))
            return
        budget.start(name)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded, the next part runs
            res["errors"].append(f"{name}: {err(e)}")
            res["failed_parts"].append(name)
            log(traceback.format_exc())
        budget.stop()
        save()

    log(f"device {res['device']['name']}; backends available: {available}; budget {budget_s:.0f} s; "
        f"output {out_dir}")
    _parts(st, budget, res, available, skip, part, save, out_dir)
    res["failures"] = failures(res)
    md = save()
    log(f"wrote {out_dir / JSON_NAME} and {out_dir / MD_NAME}")
    return md, res["failures"]


def _parts(st: Settings, budget: Budget, res: dict, available: list[str], skip: set[str], part: Callable,
           save: Callable[[], str], out_dir: Path) -> None:
    """The parts in their order (docs/gpu_check.md)."""
    timed_heads = model_heads(st.models) if "triton" in st.timing_backends and "timing" not in skip else []
    graph_heads = model_heads(("default",)) if {"graphs", "engines"} - skip else []
    part("warmup", lambda: res.update(triton_warmup=kernels.warm_triton(st, budget, timed_heads, graph_heads)),
         "triton")
    part("kernels", lambda: res["backends"].update(checks=kernels.check_backends(st, budget, available)))
    part("sparse_mla", lambda: res.update(sparse_mla=sparse_mla.check_sparse_mla(st, budget, available)), "triton")
    part("graphs", lambda: res.update(graphs=graphs.check_graphs(st, budget)), "triton")
    part("engines", lambda: res.update(engines=engines.check_engines(st, budget, available)))
    part("hybrid", lambda: res.update(hybrid=hybrid.check_hybrid(st, budget)))
    part("host", lambda: res.update(host=host.time_host(st, budget)))
    timed = [b for b in st.timing_backends if b in available]
    prepared: list[tuple[str, Path]] = []
    part("timing", lambda: timing.time_models(st, budget, timed, res, save, prepared))
    # last: the profiler attaching to CUDA graphs is the riskiest step
    part("launches", lambda: res["launches"].extend(launches.count_models(prepared, timed, st, budget, out_dir)))
    part("moe_graph", lambda: res.update(moe_graph=moe_graph.check_moe_graph(st, budget)))
    missing = [b for b in st.timing_backends if b not in available]
    if missing and "timing" not in skip:
        res["not_run"].append(("timing", f"backends not available here: {missing}"))
