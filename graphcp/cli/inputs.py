"""The input files a command's flags name, read and checked as soon as the flags are
parsed: before the command's module, torch or the model loads, so that a bad file answers
at once (``graphcp CMD: error: FILE line N: ...``, exit 2) instead of seconds later. What
was read rides on the flags' namespace for the command: ``args.requests`` (prefill,
generate), ``args.batches`` (profile). ``graphcp tune`` reads its own, already without
torch. No torch here."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from graphcp.cli.requests import kv_files, parse_conversations, parse_requests
from graphcp.errors import ConfigError, InputError
from graphcp.profile.batches import load_batches
from graphcp.runtime.capture.buckets import BucketSet


def _requests(args: argparse.Namespace) -> None:
    args.requests = parse_requests(args.input)


def _conversations(args: argparse.Namespace) -> None:
    imported = getattr(args, "import_kv", None)
    if (args.input is None) == (imported is None):
        raise InputError("give --input REQUESTS.jsonl or --import-kv DIR (exactly one)")
    args.requests = parse_conversations(args.input) if imported is None else kv_files(imported)


def _batches(args: argparse.Namespace) -> None:
    args.batches = load_batches(args)


#: each command's input file (besides the runtime flags' bucket file) and its reader
READERS: dict[str, Callable[[argparse.Namespace], None]] = {
    "prefill": _requests, "generate": _conversations, "profile": _batches}


def read_inputs(args: argparse.Namespace) -> None:
    """Every input file ``args`` names, read and checked (InputError naming the file, and
    the line where it has lines)."""
    reader = READERS.get(args.command)
    if reader is not None:
        reader(args)
    if getattr(args, "buckets", None) is not None:
        check_bucket_file(args.buckets, args.cp, args.layout)


def check_bucket_file(path: str, cp: int, layout: str) -> None:
    """``--buckets``: a bucket file (as ``graphcp tune`` writes), tuned for this run's CP
    size and layout (each rank loads it again: here it fails once, before any starts)."""
    try:
        BucketSet.load(path).check_compatible(cp, layout)
    except ConfigError as e:
        raise ConfigError(f"--buckets: {e}") from None
