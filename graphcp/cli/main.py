"""The ``graphcp`` command: ``run`` (the main job on the built-in model), ``prefill``
(a request file, logits saved), ``generate`` (greedy generation and conversations),
``tune`` (bucket capacities for a workload), ``profile`` (per-rank traces and a range
summary), ``pd-demo`` (a prefill/decode round trip)
and ``gpu-check`` (the one-shot GPU check). ``graphcp CMD --help`` for each.

Exit codes: 0 done; 2 bad input (one ``graphcp CMD: error: ...`` line on stderr,
nothing written or changed); 1 a failed run (one line) or a bug (a traceback);
130 interrupted (Ctrl-C: one line, every rank stopped).
``--debug`` or ``GRAPHCP_DEBUG=1`` adds tracebacks (each failing rank's too).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
import traceback
from collections.abc import Collection, Sequence
from typing import Callable

from graphcp.errors import debug_enabled, interrupted, one_line, report
from graphcp.jobs.args import help_text

#: the commands in ``--help``'s order: each one's line of help and the function that adds
#: its parser. Only the command given is built (and its module imported): the others'
#: modules may import torch, which ``graphcp --help`` and a mistyped flag do not wait for
COMMANDS: dict[str, tuple[str, str]] = {
    "prefill": ("prefill the requests of a JSONL file and save the logits", "graphcp.cli.parsers:add_prefill_parser"),
    "run": ("the main job on the built-in default model: capture, replay, compare",
            "graphcp.cli.parsers:add_run_parser"),
    "generate": ("greedy generation of a JSONL file's requests and conversations",
                 "graphcp.cli.parsers:add_generate_parser"),
    "tune": ("choose bucket capacities for a workload", "graphcp.tune.cli:add_tune_parser"),
    "profile": ("profile a workload: per-rank traces and a range summary", "graphcp.cli.parsers:add_profile_parser"),
    "pd-demo": ("prefill at one shape, hand the KV to a graphcp decode engine of another, check the tokens",
                "graphcp.cli.parsers:add_pd_demo_parser"),
    "gpu-check": ("the one-shot GPU check (kernels, graphs, timing, launches)",
                  "graphcp.gpucheck.cli:add_gpu_check_parser"),
}


class _Parser(argparse.ArgumentParser):
    """Usage errors follow the error contract too: one line, exit code 2 (subcommand
    parsers inherit this class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """An unknown flag is reported by the command it was given to (``graphcp prefill:
        error: unrecognized arguments: ...``): argparse leaves the leftovers of a
        subcommand to the top-level parser, which would say ``graphcp: error:``."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            commands = getattr(self, "commands", {})
            commands.get(getattr(ns, "command", None), self).error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


def load(ref: str) -> Callable:
    """The function a ``module:function`` name refers to (imported now)."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def version() -> str:
    """``graphcp --version``: graphcp's and torch's installed versions (torch is not imported)."""
    def installed(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return f"graphcp {installed('graphcp')} (torch {installed('torch')}, Python {sys.version.split()[0]})"


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. ``commands``: those whose flags are built (None: every
    one); the others stand in by name and help."""
    parser = _Parser(prog="graphcp", description=help_text(__doc__),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version())
    parser.add_argument("--debug", action="store_true", default=False,
                        help="print tracebacks of graphcp's errors (also GRAPHCP_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (line, adder) in COMMANDS.items():
        if commands is None or name in commands:
            load(adder)(sub)
        else:
            sub.add_parser(name, help=line)
    parser.commands = sub.choices  # for the unknown-flag error (_Parser.parse_args)
    for p in sub.choices.values():  # --debug after the command too; SUPPRESS keeps the top-level value
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is not a top-level flag."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    """The command line. graphcp's own errors become one stderr line and exit code 2
    (bad input) or 1 (a failed run); anything else is a bug and surfaces as one. Ctrl-C
    is one line and exit code 130, wherever it lands (torch's imports included)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = command_of(argv)
    prog = f"graphcp {command}" if command in COMMANDS else "graphcp"
    try:
        args = build_parser({command} if command in COMMANDS else ()).parse_args(argv)
        if getattr(args, "attention", None) == "triton":  # before anything imports triton
            load("graphcp.jobs.preflight:interpret_triton_on_cpu")(args, prog)
        try:
            load("graphcp.cli.inputs:read_inputs")(args)  # before the command's module (torch): at once
            func = load(args.func) if isinstance(args.func, str) else args.func
            return int(func(args) or 0)
        except Exception as e:  # noqa: BLE001 - graphcp's errors are reported, the rest re-raised
            code = report(prog, e, args.debug)
            if code is None:
                raise
            return code
    except KeyboardInterrupt:
        if debug_enabled("--debug" in argv):
            traceback.print_exc()
        _interrupt_handled()
        return interrupted(prog)


def _interrupt_handled() -> None:
    """Tell CPython the KeyboardInterrupt was handled. One that left code run by exec()
    of a string (dataclasses build their methods so, all through torch's imports) is
    marked uncaught however it is caught later, and ``python -m graphcp`` then ends by
    SIGINT (-2 to its parent) instead of the 130 returned; each exec() of a string clears
    the mark as it starts (CPython 3.11, pythonrun.c: run_eval_code_obj)."""
    exec("")
