"""The work of ``graphcp profile`` (its flags, and what it does, are in
:mod:`graphcp.cli.parsers`): warm up, then profile a measured workload, per rank,
under ``torch.profiler`` or ``nsys``, and merge the ranks' summaries."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import torch

from graphcp.errors import InputError
from graphcp.jobs.args import graph_mode
from graphcp.jobs.memory import check_local_ranks_fit, job_memory
from graphcp.jobs.preflight import job_spec
from graphcp.jobs.spec import run_job_on_ranks
from graphcp.profile import nsys
from graphcp.profile.batches import DEFAULT_BATCHES, load_batches  # noqa: F401 - their names here too
from graphcp.profile.job import ProfileJob, profile_rank
from graphcp.profile.summary import RankProfile, merge, rank_profile, write_rank, write_summary


# ---- pieces a test can check ------------------------------------------------------------
def resolve_tool(args) -> str:
    if args.tool != "auto":
        return args.tool
    return "nsys" if args.device.startswith("cuda") else "torch"


def label(args) -> str:
    graph = graph_mode(args)
    return args.label or f"{args.device}-cp{args.cp}-{'eager' if graph == 'off' else graph}"


def inner_args(args) -> list[str]:
    """The same run as explicit arguments, with ``--tool nvtx``: what nsys re-runs."""
    out = ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--cp", str(args.cp),
           "--layout", args.layout, "--graph", graph_mode(args), "--graph-backend", args.graph_backend,
           "--attention", args.attention, "--page-size", str(args.page_size), "--max-requests", str(args.max_requests),
           "--timeout", str(args.timeout), "--seed", str(args.seed), "--warmup", str(args.warmup),
           "--iters", str(args.iters), "--out", str(args.out), "--tool", "nvtx", "--label", label(args)]
    for flag, value in (("--tp", args.tp), ("--buckets", args.buckets), ("--kv-tokens", args.kv_tokens),
                        ("--workload", args.workload),
                        ("--synthetic", args.synthetic), ("--max-batches", args.max_batches)):
        if value is not None:
            out += [flag, str(value)]
    if args.dp != 1:
        out += ["--dp", str(args.dp)]
    if not args.memory_check:  # the run under nsys launches the ranks, and checks their memory
        out.append("--no-memory-check")
    return out


def run_config(args, desc: str, batches) -> dict:
    return {
        "label": label(args), "model": args.model, "device": args.device, "cp": args.cp,
        "graph": graph_mode(args), "layout": args.layout, "attention": args.attention,
        "dtype": args.dtype, "workload": desc, "batches": len(batches),
        "tokens_per_pass": int(sum(sum(e) for e, _ in batches)), "warmup": args.warmup, "iters": args.iters,
        "torch": torch.__version__.split("+")[0], "host": f"{platform.machine()}, {_cpu_count()} CPUs",
    }


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 1


# ---- the command -------------------------------------------------------------------------
def cmd_profile(args) -> int:
    if args.warmup < 0 or args.iters < 1:
        raise InputError(f"--warmup must be >= 0 and --iters >= 1, got {args.warmup} and {args.iters}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches, desc = args.batches  # read with the flags (graphcp.cli.inputs)
    config = run_config(args, desc, batches)

    if args.from_nsys is not None:
        return _summarise_nsys([Path(r) for r in args.from_nsys], out, config)
    tool = resolve_tool(args)
    if tool == "nsys":
        exe = nsys.which_nsys()
        prof = nsys.profile_cmd(out, inner_args(args), nsys=exe or "nsys")
        if exe is None:
            print("nsys is not on PATH; run these to profile with Nsight Systems:")
            print("  " + nsys.shell(prof))
            print("  " + nsys.shell(["graphcp", "profile", "--from-nsys", nsys.report_base(out) + ".nsys-rep",
                                     "--out", str(out)]))
            print("(or profile with torch.profiler instead: --tool torch)")
            return 2
        rc = subprocess.run(prof).returncode
        if rc != 0:
            print(f"graphcp profile: nsys profile exited with status {rc}: {nsys.shell(prof)}", file=sys.stderr)
            return rc
        return _summarise_nsys([Path(nsys.report_base(out) + ".nsys-rep")], out, config)

    trace_dir = Path(args.trace_dir or out)
    trace_dir.mkdir(parents=True, exist_ok=True)
    job = ProfileJob(batches, str(out), str(trace_dir), args.warmup, args.iters, tool, args.seed)
    spec = job_spec(args)
    if args.memory_check:  # each batch: its prefixes' forward, then its new tokens'
        check_local_ranks_fit(spec, job_memory(spec, [sum(part) for batch in batches for part in batch]))
    res = run_job_on_ranks(profile_rank, spec, job)
    if tool == "nvtx":  # an outer nsys holds the data; it summarises
        print(f"ran {args.iters} measured passes with NVTX ranges only (tool nvtx)")
        return 0
    if res is None:  # a non-zero torchrun rank
        return 0
    summary = merge([RankProfile.from_json(d) for d in res], config)
    _report(write_summary(out, summary), summary, trace_dir)
    return 0


def _summarise_nsys(reports: list[Path], out: Path, config: dict) -> int:
    csvs = []
    for report in reports:
        if report.suffix == ".csv":
            csvs.append(report)
            continue
        if not report.is_file():
            raise InputError(f"nsys report {report} not found")
        prefix = out / report.name.removesuffix(".nsys-rep")
        exe = nsys.which_nsys()
        if exe is None:
            raise InputError(f"nsys is not on PATH; export the CSV elsewhere with: "
                             f"{nsys.shell(nsys.stats_cmd(report, prefix))}, then pass it to --from-nsys")
        csvs.append(nsys.csv_path(prefix))
        csvs[-1].unlink(missing_ok=True)  # nsys stats skips an export whose file exists
        if subprocess.run(nsys.stats_cmd(report, prefix, exe)).returncode != 0:
            raise InputError(f"nsys stats failed on {report}: {nsys.shell(nsys.stats_cmd(report, prefix, exe))}")
    per_rank = nsys.events_from_pushpop_csv(csvs, nsys.read_rank_pids(out))
    ranks = [rank_profile(r, evs, meta={"source": ", ".join(map(str, reports))}) for r, evs in per_rank.items()]
    for rp in ranks:
        write_rank(out, rp)
    summary = merge(ranks, {**config, "tool": "nsys"})
    _report(write_summary(out, summary), summary, None)
    return 0


def _report(paths, summary: dict, trace_dir: Path | None) -> None:
    fwd = summary["forward"]
    print(f"profiled {fwd['count']} forwards on {len(summary['ranks'])} rank(s): "
          f"{fwd['total_ms']:.1f} ms in `prefill` per rank")
    for p in paths:
        print(f"  {p}")
    if trace_dir is not None:
        print(f"  Chrome traces: {trace_dir}/trace_rank<r>.json (open in https://ui.perfetto.dev)")
    sys.stdout.flush()
