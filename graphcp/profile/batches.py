"""The batches ``graphcp profile`` runs: ``--workload`` / ``--synthetic``, or its default
workload. No torch here: they are read and checked as soon as the flags are parsed
(:mod:`graphcp.cli.inputs`)."""

from __future__ import annotations

import argparse

from graphcp.errors import InputError
from graphcp.tune.workload import load_workload

#: the default workload: six small CP batches (mixed sizes, two with cached
#: prefixes) that land in the 128- and 256-row buckets at CP = 2: a few
#: seconds on a laptop CPU with the default model, two cheap captures.
DEFAULT_BATCHES: list[tuple[list[int], list[int]]] = [
    ([384], [0]),
    ([160, 96, 48, 7, 1], [0, 0, 0, 0, 0]),
    ([256], [256]),
    ([120, 120, 60], [0, 200, 0]),
    ([128, 64, 33, 15], [0, 0, 0, 0]),
    ([448], [0]),
]


def load_batches(args: argparse.Namespace) -> tuple[list[tuple[list[int], list[int]]], str]:
    """(batches, description) from --workload / --synthetic, or the default workload."""
    if args.workload is None and args.synthetic is None:
        batches, desc = list(DEFAULT_BATCHES), "default (graphcp.profile.cli.DEFAULT_BATCHES)"
    else:
        w = load_workload(args.workload, args.synthetic, args.seed)
        batches = [w.batch(b) for b in range(w.n_batches)]
        desc = args.workload or f"synthetic {args.synthetic} (seed {args.seed})"
    if args.max_batches is not None:
        if args.max_batches < 1:
            raise InputError(f"--max-batches must be >= 1, got {args.max_batches}")
        batches = batches[: args.max_batches]
    return batches, desc
