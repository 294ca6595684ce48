"""``graphcp gpu-check``: the one-shot GPU check, built to run on a lent GPU machine
as it is (one GPU; torch, triton, numba, transformers; no nvtx, no flashinfer, no
network): the default run plans for 200 s on one H200, start-up and Triton compilation
included; ``--full`` adds the larger model, 32K tokens and more kernel plans. From the
repository root, with graphcp taken from the working tree (no install needed)::

    PYTHONPATH=. python scripts/gpu_check.py --out "$OUT"      # or: python -m graphcp gpu-check --out "$OUT"
    PYTHONPATH=. python scripts/gpu_check.py --dry-run          # the same flow on a CPU

Parts, each with a share of the time budget (``settings.PHASES``; time a part leaves
passes on): ``warmup`` (every Triton variant the run launches, compiled first),
``kernels`` (every available attention backend against the torch reference),
``sparse_mla`` (the DSA models' sparse MLA Triton kernel past 32-bit offsets),
``graphs`` (breakable and full ``cuda`` graphs at CP = 1: every replay equals the
same-bucket eager body bitwise), ``engines`` (DeepSeek V4, MoE tp and ep, an EAGLE-3
draft's graphs), ``hybrid`` (a linear-attention hybrid on the machine's linear kernels,
graphs and a varlen batch), ``host`` (one rank's host preparation, timed), ``timing`` (eager vs
breakable vs full prefill), ``launches`` (kernels and launches per forward, with
``torch.profiler`` traces), ``moe_graph`` (a MoE layer's grouped matmuls captured and
replayed with changing routing; last).

The command exits 1 when a part raised or did not run, a checked row failed or errored,
a graph path ran eagerly, or the budget left a row out; it names each. Writes
``gpu_check.json`` and ``gpu_check.md`` to ``--out`` (default ``$OUT`` when set, else
``$GRAPHCP_CACHE/gpu_check`` or ``~/.cache/graphcp/gpu_check``) after every part; the
Markdown is printed last on stdout, progress goes to stderr. docs/gpu_check.md has the
details, and what a one-GPU machine cannot check.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable

import torch

from graphcp.attention.registry import BACKENDS
from graphcp.errors import InputError
from graphcp.gpucheck.common import log
from graphcp.gpucheck.run import run_check
from graphcp.gpucheck.settings import (
    BUDGET_S,
    DRY_BUDGET_S,
    FULL_BUDGET_S,
    LARGE_MODEL,
    PARTS,
    default_budget_s,
    settings_from_args,
)
from graphcp.jobs.args import help_text
from graphcp.model.presets import PRESETS, cache_root


def csv_of(cast: Callable = str, choices: tuple[str, ...] | None = None, lo: float | None = None) -> Callable:
    """An argparse type: a comma-separated list of ``cast`` values (from ``choices``, at least ``lo``)."""
    def parse(s: str) -> tuple:
        try:
            out = tuple(cast(x.strip()) for x in s.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {cast.__name__} values, got {s!r}") from None
        bad = [x for x in out if (choices is not None and x not in choices) or (lo is not None and x < lo)]
        if bad or not out:
            want = f"one or more of {', '.join(choices)}" if choices else f"values >= {lo}"
            raise argparse.ArgumentTypeError(f"expected {want}, got {s!r}")
        return out

    parse.__name__ = "list"
    return parse


def at_least(cast: Callable, lo: float) -> Callable:
    """An argparse type: a ``cast`` value >= ``lo``."""
    def parse(s: str):
        try:
            v = cast(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {cast.__name__} >= {lo}, got {s!r}") from None
        if not v >= lo:
            raise argparse.ArgumentTypeError(f"expected {cast.__name__} >= {lo}, got {s!r}")
        return v

    parse.__name__ = cast.__name__
    return parse


def add_gpu_check_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("gpu-check", help="the one-shot GPU check (kernels, graphs, timing, launches)",
                              description=help_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=default_out(),
                   help="output folder for gpu_check.json, gpu_check.md and the traces (default: $OUT when set, "
                        "else %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="the whole flow on the CPU at tiny sizes")
    p.add_argument("--full", action="store_true",
                   help=f"the full run: {LARGE_MODEL} too, 32K tokens, more kernel plans (longer than a lent "
                        "machine's default run; see docs/gpu_check.md)")
    p.add_argument("--models", type=csv_of(choices=tuple(PRESETS)), default=None,
                   help=f"comma-separated presets to time (default: default; --full: default,{LARGE_MODEL})")
    p.add_argument("--skip-large", action="store_true", help=f"do not time {LARGE_MODEL}")
    p.add_argument("--large-layers", type=at_least(int, 0), default=8,
                   help=f"num_hidden_layers of {LARGE_MODEL} (default %(default)s of its 16; 0: the preset's own)")
    p.add_argument("--sizes", type=csv_of(int, lo=1), default=None,
                   help="new tokens per timed prefill (default 1024,8192; --full 1024,8192,32768; dry run 32,96)")
    p.add_argument("--backends", type=csv_of(choices=BACKENDS), default=None,
                   help="attention backends to time (default: triton on a GPU, torch in a dry run)")
    p.add_argument("--repeats", type=at_least(int, 1), default=None, help="timed runs per row (default 5; dry run 2)")
    p.add_argument("--warmup", type=at_least(int, 1), default=None, help="warm-up runs per row (default 2; dry run 1)")
    p.add_argument("--item-cap-s", type=at_least(float, 0.0), default=None,
                   help="seconds one timed row may take; repeats shrink to fit (default 4; --full 8; dry run 2)")
    p.add_argument("--budget-s", type=at_least(float, 0.0), default=None,
                   help="wall-clock budget of the run after start-up; parts get shares of it (default: the sum of "
                        f"the shares and the report's reserve: {BUDGET_S:.0f} s, --full {FULL_BUDGET_S:.0f} s, dry run "
                        f"{DRY_BUDGET_S:.0f} s)")
    p.add_argument("--no-profile", action="store_true", help="no torch.profiler (launch counts from host ops only)")
    p.add_argument("--no-triton", action="store_true", help="dry run: leave triton out (no interpreter)")
    p.add_argument("--skip", type=csv_of(choices=PARTS), default=(),
                   help=f"comma-separated parts to skip: {','.join(PARTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_gpu_check)
    return p


def default_out() -> str:
    """``$OUT`` when the environment names an output folder, else a folder in graphcp's
    cache: never the current folder (a checkout stays clean)."""
    return os.environ.get("OUT") or str(cache_root() / "gpu_check")


def cmd_gpu_check(args: argparse.Namespace) -> int:
    st = settings_from_args(args)
    budget_s = args.budget_s if args.budget_s is not None else default_budget_s(st)
    if st.dry_run and not args.no_triton:
        # the triton backend runs on CPU only under the interpreter, chosen before its kernel module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not st.dry_run:
        if not torch.cuda.is_available():
            raise InputError("no CUDA device here; run with --dry-run to exercise the flow on the CPU")
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            log("warning: TRITON_INTERPRET is set: triton kernels would run in the interpreter; unset it")
        torch.set_float32_matmul_precision("highest")  # the float32 reference without TF32
    options = {k: v for k, v in vars(args).items() if k not in ("func", "command", "debug")}
    md, failed = run_check(st, Path(args.out), budget_s, set(args.skip), options, no_triton=args.no_triton)
    print(md, end="", flush=True)
    if failed:
        log(f"FAILED: {len(failed)} check(s) failed, errored or did not run: " + "; ".join(failed))
        return 1
    return 0
