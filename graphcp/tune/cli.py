"""``graphcp tune``: workload -> optimal bucket file, with a report against the usual schedules.

    graphcp tune --workload FILE | --synthetic SPEC --cp N [--layout zigzag|interleave]
                 [--align A] [--max-buckets K] [--max-capacity R] [--padding-factor F]
                 [--eager-penalty P] [--bucket-cost W] [--baselines sglang,vllm,trtllm|none]
                 --output buckets.json [--plot tune.png] [--report-json FILE] [--measure] [--seed S]

Also runs standalone, without the runtime's imports: ``python -m graphcp.tune.cli tune ...``.
Exit codes: 0 done, 2 bad input (the message on stderr names the bad value).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from graphcp.checks import MAX_CP, check_int, check_output_path
from graphcp.errors import InputError, report
from graphcp.runtime.capture.buckets import DEFAULT_PADDING_FACTOR, BucketSet
from graphcp.tune.baselines import BASELINES
from graphcp.tune.optimise import CostModel, optimise
from graphcp.tune.report import build_report
from graphcp.tune.required import LAYOUTS, required_rows
from graphcp.tune.settings import check_costs, check_search, flag_name
from graphcp.tune.workload import load_workload

DEFAULT_MAX_BUCKETS = 8
DEFAULT_MAX_CAPACITY = 8192  # local rows; the static buffers are sized by the largest bucket


MAX_SEED = 2**63 - 1


class TuneInputError(InputError):
    """Bad command-line input; reported on stderr with exit code 2."""


def add_tune_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune",
        help="choose bucket capacities for a workload",
        description="Choose at most K local-row capacities that minimise padding (and eager fallbacks) "
        "on a workload, write them as a bucket file, and compare with the usual fixed schedules.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", metavar="FILE", help='JSONL, one batch a line: {"extend": [...], "prefix": [...]}')
    src.add_argument("--synthetic", metavar="SPEC", help="NAME[:k=v,...] with NAME longctx, chunked or short")
    p.add_argument("--cp", type=int, required=True, metavar="N", help="context-parallel size")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag",
                   help="how a request's tokens are split over the CP ranks (default: %(default)s)")
    p.add_argument("--align", type=int, default=8, metavar="A", help="capacities are multiples of A (default 8)")
    p.add_argument(
        "--max-buckets",
        type=int,
        default=DEFAULT_MAX_BUCKETS,
        metavar="K",
        help="at most K capacities (default %(default)s)",
    )
    p.add_argument(
        "--max-capacity",
        type=int,
        default=DEFAULT_MAX_CAPACITY,
        metavar="R",
        help=f"largest capacity in local rows (default {DEFAULT_MAX_CAPACITY}); larger batches run eagerly",
    )
    p.add_argument(
        "--padding-factor",
        type=float,
        default=DEFAULT_PADDING_FACTOR,
        metavar="F",
        help="eager when capacity > F * required rows (default %(default)s)",
    )
    p.add_argument(
        "--eager-penalty",
        type=float,
        default=None,
        metavar="P",
        help="an eager batch of r rows costs P*r row-equivalents; P >= F (default: F)",
    )
    p.add_argument(
        "--bucket-cost",
        type=float,
        default=0.0,
        metavar="W",
        help="each bucket costs W mean rows per batch (capture time); 0 = use all K if they help (default: 0)",
    )
    p.add_argument("--baselines", default=",".join(BASELINES),
                   help="the schedules to compare with: a comma list of them, or none (default: %(default)s)")
    p.add_argument("--output", required=True, metavar="buckets.json", help="the bucket file to write (BucketSet JSON)")
    p.add_argument("--plot", metavar="PNG", help="histogram with the buckets, and cost vs bucket count")
    p.add_argument("--report-json", metavar="FILE", help="the full report (every row, the curve) as JSON")
    p.add_argument("--measure", action="store_true", help="capture the tuned buckets and record time and memory")
    p.add_argument("--model", default="default",
                   help="model captured by --measure (preset name or folder; default: %(default)s)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="device --measure captures on (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of --synthetic (default 0)")
    p.set_defaults(func=run_tune)
    return p


def _check(args) -> list[str]:
    """Every flag type-, range- and finiteness-checked (NaN and inf pass no range check
    silently: they are refused by name), and the outputs writable, before any work."""
    err = TuneInputError
    check_int(args.cp, "--cp", lo=1, hi=MAX_CP, err=err)
    check_search(args.max_buckets, args.align, args.max_capacity, flag_name, err)
    check_costs(args.padding_factor, args.eager_penalty, args.bucket_cost, flag_name, err)
    check_int(args.seed, "--seed", lo=0, hi=MAX_SEED, err=err)
    for flag, path in (("--output", args.output), ("--plot", args.plot), ("--report-json", args.report_json)):
        if path is not None:
            check_output_path(path, flag, err=err)
    if args.plot is not None:
        _check_plot_installed()
    names = (
        [] if args.baselines.strip().lower() == "none" else [s.strip() for s in args.baselines.split(",") if s.strip()]
    )
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise TuneInputError(f"--baselines: unknown {unknown}; expected a comma list of {sorted(BASELINES)} or none")
    return names


def _check_plot_installed() -> None:
    """``--plot`` draws with matplotlib, an optional extra: refused up front when it is not
    importable, before the bucket file is written (the plot comes last)."""
    try:
        import matplotlib  # noqa: F401 - only whether it imports
    except ImportError:
        raise TuneInputError('--plot needs matplotlib, which is not installed: pip install -e ".[plot]" '
                             "(or drop --plot)") from None


def _measure(bucket_set: BucketSet, cp_size: int, model: str = "default", device: str = "cpu") -> list[dict]:
    try:
        from graphcp.tune.measure import measure_capture  # lazy: needs torch and a capture backend
    except ImportError as e:
        raise TuneInputError(f"--measure needs graphcp.tune.measure: {e}") from e
    rows = measure_capture(bucket_set, cp_size, model=model, device=device)
    for r in rows:
        missing = {"capacity", "capture_s", "pool_bytes"} - set(r)
        if missing:
            raise TuneInputError(f"measure_capture returned {r!r}, missing {sorted(missing)}")
    return [
        dict(capacity=int(r["capacity"]), capture_s=float(r["capture_s"]), pool_bytes=int(r["pool_bytes"]))
        for r in rows
    ]


def run_tune(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except InputError as e:  # graphcp's own input errors only: anything else is a bug and surfaces
        return report("graphcp tune", e, getattr(args, "debug", False))


def _run(args: argparse.Namespace) -> int:
    names = _check(args)
    t0 = time.perf_counter()
    workload = load_workload(args.workload, args.synthetic, args.seed)
    required = required_rows(workload, args.cp, args.layout)
    model = CostModel(args.padding_factor, args.eager_penalty, args.bucket_cost)
    tuned = optimise(required, args.max_buckets, args.align, args.max_capacity, model)
    tune_s = time.perf_counter() - t0

    capacities = tuned.capacities
    if not capacities:
        # every batch is over max capacity: a bucket file still needs one capacity
        capacities = (tuned.max_capacity,)
        print(
            f"graphcp tune: warning: every batch needs more than --max-capacity={args.max_capacity} rows; "
            "they all run eagerly",
            file=sys.stderr,
        )
    settings = dict(
        cp_size=args.cp,
        layout=args.layout,
        align=args.align,
        padding_factor=args.padding_factor,
        bucket_cost=args.bucket_cost,
        max_capacity=tuned.max_capacity,
        max_buckets=args.max_buckets,
    )
    tuned_set = BucketSet(capacities, args.align, args.padding_factor, args.cp, args.layout)
    measured = (_measure(tuned_set, args.cp, getattr(args, "model", "default"), getattr(args, "device", "cpu"))
                if args.measure else None)
    baselines = {n: BASELINES[n].bucket_set(args.cp, args.align, args.padding_factor) for n in names}
    report = build_report(required, tuned, tuned_set, baselines, settings, workload.summary(), measured)

    expected = report.tuned.to_json()
    meta = {
        "tuned_by": "graphcp tune",
        "workload": report.workload,
        "settings": report.settings,
        "expected": {
            k: expected[k] for k in ("overhead", "padding_waste", "mean_padded_rows", "eager_rate", "cost", "real_rows")
        },
        "over_max_capacity_share": report.over_max_capacity / workload.n_batches,
        # best set for every k <= K under --max-capacity (report.pareto may reach past it)
        "pareto": [
            {"k": pt.k, "capacities": list(pt.capacities), "overhead": pt.cost / tuned.real_rows - 1.0}
            for pt in tuned.pareto
        ],
        "tune_seconds": round(tune_s, 4),
    }
    if measured:
        meta["measured"] = measured
    BucketSet(capacities, args.align, args.padding_factor, args.cp, args.layout, meta=_plain(meta)).save(args.output)

    print(report.markdown())
    print(f"\nwrote {args.output} ({len(capacities)} buckets, tuned in {tune_s:.2f} s)")
    if args.report_json:
        report.write_json(args.report_json)
        print(f"wrote {args.report_json}")
    if args.plot:
        report.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def _plain(obj):
    """numpy scalars -> Python numbers, so the bucket file is plain JSON."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphcp")
    sub = parser.add_subparsers(dest="command", required=True)
    add_tune_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
