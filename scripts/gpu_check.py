#!/usr/bin/env python
"""One-shot GPU check of graphcp, built to run on the lent machine as it is
(torch + triton + safetensors + tqdm; no nvtx, no flashinfer, no network):
under 8 minutes on one H200, Triton compilation included. From the repository
root, with graphcp taken from the working tree::

    PYTHONPATH=. python scripts/gpu_check.py --out "$OUT"
    PYTHONPATH=. python scripts/gpu_check.py --dry-run --out /tmp/gc    # the same flow on a CPU

Parts, each with a share of the time budget (``gpucheck.common.PHASES``; time a
part leaves passes on, what does not fit is recorded as skipped):

1. ``warmup``: every Triton kernel variant the run launches, compiled first
   (compiles counted, registers and spills read from the compiled kernels).
2. ``kernels``: every available attention backend against the torch reference
   (prefixes, zigzag segments, LSE), bfloat16 and float32.
3. ``graphs``: the ``cuda`` graph backend, breakable and full, CP = 1: every
   replay equals the same-bucket eager body bitwise (capture self-check on
   where this graphcp has one).
4. ``timing``: eager vs breakable vs full prefill at 1K / 8K / 32K tokens.
5. ``launches``: kernels, launch calls and graph launches per forward, from a
   ``torch.profiler`` trace whose Chrome trace (with the graphcp ranges, the
   NVTX names) is written to the output folder.

Writes ``gpu_check.json`` and ``gpu_check.md`` to ``--out`` (default ``$OUT``
when set), after every part, so a run that dies leaves what it had; the
Markdown is printed last on stdout, progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# the gpucheck parts, and graphcp from this working tree (whatever else is installed)
for _path in (str(HERE), str(HERE.parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from gpucheck.common import (  # noqa: E402
    DRY_PHASES, FLASHINFER_ABSENT, LARGE_MODEL, PHASES, SCHEMA_VERSION, Budget, Settings, device_info, env_info,
    err, log,
)
from gpucheck.report import write_report  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_results",
                   help="output folder for gpu_check.json, gpu_check.md and the traces (default: $OUT when set, "
                        "else %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="the whole flow on the CPU at tiny sizes")
    p.add_argument("--models", default=None,
                   help=f"comma-separated presets to time (default: default,{LARGE_MODEL}; dry run: default)")
    p.add_argument("--skip-large", action="store_true", help=f"do not time {LARGE_MODEL}")
    p.add_argument("--large-layers", type=int, default=8,
                   help=f"num_hidden_layers of {LARGE_MODEL} (default %(default)s of its 16; 0: the preset's own)")
    p.add_argument("--sizes", default=None, help="new tokens per timed prefill (default 1024,8192,32768; dry run 32,96)")
    p.add_argument("--backends", default=None,
                   help="attention backends to time (default: triton on a GPU, torch in a dry run)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per row (default 5; dry run 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs per row (default 2; dry run 1)")
    p.add_argument("--item-cap-s", type=float, default=None,
                   help="seconds one timed row may take; repeats shrink to fit (default 8; dry run 2)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="wall-clock budget of the whole run; parts get shares of it (default %(default)s)")
    p.add_argument("--no-profile", action="store_true", help="no torch.profiler (launch counts from host ops only)")
    p.add_argument("--no-triton", action="store_true", help="dry run: leave triton out (no interpreter)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: kernels,graphs,timing,launches")
    p.add_argument("--seed", type=int, default=0)
    return p


def _csv(s: str | None, cast=str) -> tuple | None:
    return None if s is None else tuple(cast(x) for x in s.split(",") if x.strip())


def settings_from_args(a: argparse.Namespace) -> Settings:
    dry = a.dry_run
    models = _csv(a.models) or (("default",) if dry else ("default", LARGE_MODEL))
    if a.skip_large:
        models = tuple(m for m in models if m != LARGE_MODEL)
    return Settings(
        dry_run=dry,
        device="cpu" if dry else "cuda",
        graph_backend="trace" if dry else "cuda",
        check_dtypes=("float32", "bfloat16"),
        check_heads=((2, 1, 64), (2, 1, 128)) if dry else ((8, 2, 64), (16, 4, 128)),
        check_random_plans=1 if dry else 4,
        check_max_extend=24 if dry else 3000,
        check_max_prefix=20 if dry else 2000,
        page_size=16,
        # the CPU trace backend replays float32 bodies exactly; bfloat16 is checked on the GPU
        graph_dtypes=("float32",) if dry else ("bfloat16", "float32"),
        # dry run: the interpreted Triton kernel only where it must be (inside the full graph)
        graph_attention={"breakable": "torch" if dry else "triton", "full": "triton"},
        graph_buckets=(48,) if dry else (256, 1024),
        graph_batches=((9, 3, 20),) if dry else ((700,), (300, 9, 61, 2), (1000,)),
        timing_dtype="float32" if dry else "bfloat16",
        models=models,
        large_layers=a.large_layers or None,
        sizes=_csv(a.sizes, int) or ((32, 96) if dry else (1024, 8192, 32768)),
        timing_backends=_csv(a.backends) or (("torch",) if dry else ("triton",)),
        repeats=a.repeats or (2 if dry else 5),
        warmup=a.warmup or (1 if dry else 2),
        item_cap_s=a.item_cap_s or (2.0 if dry else 8.0),
        profile=not a.no_profile,
        seed=a.seed,
        phases=dict(DRY_PHASES if dry else PHASES),
    )


def _model_heads(models: tuple[str, ...]) -> list[tuple[int, int, int]]:
    from graphcp.model.presets import PRESETS

    out = []
    for m in models:
        c = PRESETS.get(m)
        if c is not None:
            out.append((c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    st = settings_from_args(args)
    skip = set(_csv(args.skip) or ())
    if st.dry_run and not args.no_triton:
        # the triton backend runs on CPU only under the interpreter, chosen before its kernel module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not st.dry_run:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; run with --dry-run to exercise the flow on the CPU",
                  file=sys.stderr)
            return 2
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            log("warning: TRITON_INTERPRET is set: triton kernels would run in the interpreter; unset it")
        torch.set_float32_matmul_precision("highest")  # the float32 reference without TF32
    from graphcp.attention.registry import available_backends

    from gpucheck import graphs, kernels, timing

    budget = Budget(args.budget_s, st.phases, reserve_s=2.0 if st.dry_run else 10.0)
    device = torch.device(st.device)
    out_dir = Path(args.out)
    available = available_backends(device)
    if st.dry_run and args.no_triton and "triton" in available:
        available.remove("triton")
    env = env_info()
    notes = [] if env["flashinfer_importable"] else [FLASHINFER_ABSENT]
    if not env["nvtx"]:
        notes.append("the nvtx package is missing: graphcp's ranges reach torch.profiler (the traces here) but "
                     "not NVTX/nsys")
    res: dict[str, Any] = {
        "schema": SCHEMA_VERSION, "dry_run": st.dry_run,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": 0.0, "budget_s": args.budget_s, "device": device_info(device), "env": env, "notes": notes,
        "settings": {k: v for k, v in vars(st).items()}, "argv": list(argv) if argv is not None else sys.argv[1:],
        "phases": {"shares": st.phases, "used": budget.used},
        "triton_warmup": None, "backends": {"available": available, "checked": available, "checks": []},
        "graphs": [], "models": {}, "timing": [], "launches": [], "captures": [], "errors": [],
    }
    for n in notes:
        log(n)

    def save() -> str:
        res["elapsed_s"] = round(budget.elapsed(), 2)
        return write_report(res, out_dir)

    def part(name: str, fn) -> None:
        if name in skip:
            return
        budget.start(name)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded, the next part runs
            res["errors"].append(f"{name}: {err(e)}")
            log(traceback.format_exc())
        budget.stop()
        save()

    log(f"device {res['device']['name']}; backends available: {available}; budget {args.budget_s:.0f} s; "
        f"output {out_dir}")
    if "triton" in available:
        timed_heads = _model_heads(st.models) if "triton" in st.timing_backends and "timing" not in skip else []
        graph_heads = _model_heads(("default",)) if "graphs" not in skip else []
        part("warmup", lambda: res.update(triton_warmup=kernels.warm_triton(st, budget, timed_heads, graph_heads)))
    part("kernels", lambda: res["backends"].update(checks=kernels.check_backends(st, budget, available)))
    if "triton" in available:
        part("graphs", lambda: res.update(graphs=graphs.check_graphs(st, budget)))
    else:
        res["errors"].append("graphs: skipped, the triton backend is not available")

    timed = [b for b in st.timing_backends if b in available]
    prepared: list[tuple[str, Path]] = []

    def run_timing() -> None:
        for model in st.models:
            try:
                if not budget.allows(20.0):
                    raise TimeoutError("time budget")
                layers = st.large_layers if model == LARGE_MODEL else None
                folder, label = timing.prepare_model(model, layers)
                import json

                res["models"][label] = {"preset": model, "dir": str(folder),
                                        "config": json.loads((folder / "config.json").read_text())}
            except Exception as e:  # noqa: BLE001
                status = "skipped" if isinstance(e, TimeoutError) else "error"
                for b in timed:
                    for p in timing.PATHS:
                        for n in st.sizes:
                            res["timing"].append({**timing._row(model, b, p, n), "status": status, "error": err(e)})
                if status == "error":
                    res["errors"].append(f"model {model}: {err(e)}")
                continue
            prepared.append((label, folder))
            for b in timed:
                got = timing.time_paths(label, folder, b, st, budget)
                for k in ("timing", "captures"):
                    res[k].extend(got[k])
                save()

    def run_launches() -> None:
        for i, (label, folder) in enumerate(prepared):
            for b in timed:
                res["launches"].extend(timing.count_paths(label, folder, b, st, budget, out_dir if i == 0 else None))

    part("timing", run_timing)
    part("launches", run_launches)  # last: the profiler attaching to CUDA graphs is the riskiest step
    missing = [b for b in st.timing_backends if b not in available]
    if missing:
        res["errors"].append(f"timing: backends not available here: {missing}")
    md = save()
    log(f"wrote {out_dir / 'gpu_check.json'} and {out_dir / 'gpu_check.md'}")
    sys.stderr.flush()
    print(md, end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
