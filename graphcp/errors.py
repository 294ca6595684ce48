"""The errors graphcp raises on purpose, and how the command line reports them.

Every error graphcp raises deliberately derives from :class:`GraphcpError`:

- :class:`InputError` (also a ``ValueError``): bad input (a config file, a flag, a
  request or workload file, an API argument). Nothing was changed. Exit code 2.
- :class:`ConfigError`: a model, runtime, parallel or bucket configuration.
- :class:`BatchError`: a batch ``PrefillEngine.prefill`` refused. The KV cache is
  exactly as it was (allocator state and pool contents). Its subclasses
  ``graphcp.kv.handle.KVHandleError`` (a released, stale, foreign or repeated prefix
  handle) and ``graphcp.kv.handle.KVCacheFull`` (the batch does not fit the pool)
  are batch errors too: catching ``BatchError`` catches every refused batch.
- other ``GraphcpError`` (a collective that timed out, ranks given different
  batches): the run failed, not the input. Exit code 1, one line.

Anything else is a bug in graphcp: the command line lets it surface with its
traceback. With ``--debug`` or ``GRAPHCP_DEBUG=1`` graphcp's own errors print their
traceback (and, under ``--cp N``, the failing rank's) before the one line.

This module imports nothing heavy: the tuner runs without torch.
"""

from __future__ import annotations

import os
import sys
import traceback


class GraphcpError(Exception):
    """Base of every error graphcp raises deliberately."""


class InputError(GraphcpError, ValueError):
    """Bad input (file, flag, argument); nothing was changed."""


class ConfigError(InputError):
    """A model, runtime, parallel or bucket configuration graphcp refuses."""


class BatchError(InputError):
    """A batch ``prefill`` refused; the KV cache is unchanged."""


EXIT_INPUT = 2  # bad input: nothing was changed
EXIT_FAILURE = 1  # graphcp's own runtime failure, or a bug
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): the shells' 128 + 2


def debug_enabled(flag: bool = False) -> bool:
    return flag or os.environ.get("GRAPHCP_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def stderr_is_terminal() -> bool:
    """Whether stderr is a terminal: only there are progress bars drawn
    (graphcp/runtime/progress.py); a log or a pipe gets whole lines only. Ranks share
    the launcher's stderr, so every process of a run decides alike."""
    return sys.stderr is not None and sys.stderr.isatty()


def interrupted(prog: str) -> int:
    """Report a Ctrl-C: one line on stderr, on a line of its own (on a terminal a
    rank's progress bar or the echoed ``^C`` may have left the cursor mid-line, which
    the launcher cannot see); the exit code."""
    print(("\n" if stderr_is_terminal() else "") + f"{prog}: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def one_line(msg: object) -> str:
    """A message on one line (a multi-line message would break the one-line contract)."""
    return " | ".join(part.strip() for part in str(msg).splitlines() if part.strip())


def user_error(e: BaseException) -> "GraphcpError | None":
    """The graphcp error to report for ``e``: itself, or what a launched rank raised
    (``RankFailure.cause``); None when ``e`` is a bug or an interruption."""
    if not isinstance(e, GraphcpError) or getattr(e, "rank_bug", False):
        return None
    cause = getattr(e, "cause", None)  # RankFailure: report the rank's own error
    return cause if isinstance(cause, GraphcpError) else e


def report(prog: str, e: BaseException, debug: bool = False) -> int | None:
    """Print ``e`` as one stderr line and return the exit code, or return None when
    ``e`` is not graphcp's (the caller re-raises it: a bug surfaces as one)."""
    err = user_error(e)
    if err is None:
        tbs = getattr(e, "tracebacks", None)  # a rank's bug: its traceback is the useful one
        for rank, tb in sorted((tbs or {}).items()):
            print(f"--- rank {rank} ---\n{tb}", file=sys.stderr, end="")
        return None
    if debug_enabled(debug):
        traceback.print_exception(e, file=sys.stderr)
        for rank, tb in sorted((getattr(e, "tracebacks", None) or {}).items()):
            print(f"--- rank {rank} ---\n{tb}", file=sys.stderr, end="")
    print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
    return EXIT_INPUT if isinstance(err, InputError) else EXIT_FAILURE
