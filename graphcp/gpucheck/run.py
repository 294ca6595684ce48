"""One GPU-check run: the parts in order, each inside its share of the budget,
the report rewritten after every part (a run that dies leaves what it had)."""

from __future__ import annotations

import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from graphcp.attention.registry import available_backends
from graphcp.gpucheck import graphs, kernels, launches, moe_graph, sparse_mla, timing
from graphcp.gpucheck.budget import Budget
from graphcp.gpucheck.common import FLASHINFER_ABSENT, device_info, env_info, err, log
from graphcp.gpucheck.report import JSON_NAME, MD_NAME, SCHEMA_VERSION, failures, write_report
from graphcp.gpucheck.settings import Settings, model_heads


def run_check(st: Settings, out_dir: Path, budget_s: float, skip: set[str], options: dict,
              no_triton: bool = False) -> tuple[str, list[str]]:
    """Run every part not in ``skip``; write ``gpu_check.json`` and ``gpu_check.md``
    into ``out_dir``; return the Markdown and what failed (:func:`failures`: empty when
    every part ran clean). ``no_triton``: leave Triton out (dry run)."""
    budget = Budget(budget_s, st.phases, reserve_s=2.0 if st.dry_run else 10.0)
    device = torch.device(st.device)
    available = available_backends(device)
    if no_triton and "triton" in available:
        available.remove("triton")
    env = env_info()
    notes = [] if env["flashinfer_importable"] else [FLASHINFER_ABSENT]
    if not env["nvtx"]:
        notes.append("the nvtx package is missing: graphcp's ranges reach torch.profiler (the traces here) but "
                     "not NVTX/nsys")
    if not env["host_kernels_compiled"]:
        notes.append("numba is missing: graphcp's host kernels ran as Python (the same results; host times here "
                     "are not the compiled path's)")
    res: dict[str, Any] = {
        "schema": SCHEMA_VERSION, "dry_run": st.dry_run,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": 0.0, "budget_s": budget_s, "device": device_info(device), "env": env, "notes": notes,
        "settings": dict(vars(st)), "options": options,
        "phases": {"shares": st.phases, "used": budget.used},
        "triton_warmup": None, "backends": {"available": available, "checked": available, "checks": []},
        "graphs": [], "models": {}, "timing": [], "launches": [], "captures": [], "sparse_mla": [], "moe_graph": [],
        "errors": [], "failed_parts": [],
    }
    for n in notes:
        log(n)

    def save() -> str:
        res["elapsed_s"] = round(budget.elapsed(), 2)
        return write_report(res, out_dir)

    def part(name: str, fn: Callable[[], None]) -> None:
        if name in skip:
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
    if "triton" in available:
        timed_heads = model_heads(st.models) if "triton" in st.timing_backends and "timing" not in skip else []
        graph_heads = model_heads(("default",)) if "graphs" not in skip else []
        part("warmup", lambda: res.update(triton_warmup=kernels.warm_triton(st, budget, timed_heads, graph_heads)))
    part("kernels", lambda: res["backends"].update(checks=kernels.check_backends(st, budget, available)))
    part("sparse_mla", lambda: res.update(sparse_mla=sparse_mla.check_sparse_mla(st, budget, available)))
    if "triton" in available:
        part("graphs", lambda: res.update(graphs=graphs.check_graphs(st, budget)))
    else:
        res["errors"].append("graphs: skipped, the triton backend is not available")

    timed = [b for b in st.timing_backends if b in available]
    prepared: list[tuple[str, Path]] = []
    part("timing", lambda: timing.time_models(st, budget, timed, res, save, prepared))
    # last: the profiler attaching to CUDA graphs is the riskiest step
    part("launches", lambda: res["launches"].extend(launches.count_models(prepared, timed, st, budget, out_dir)))
    part("moe_graph", lambda: res.update(moe_graph=moe_graph.check_moe_graph(st, budget)))
    missing = [b for b in st.timing_backends if b not in available]
    if missing:
        res["errors"].append(f"timing: backends not available here: {missing}")
    res["failures"] = failures(res)
    md = save()
    log(f"wrote {out_dir / JSON_NAME} and {out_dir / MD_NAME}")
    return md, res["failures"]
