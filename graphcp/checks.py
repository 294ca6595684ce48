"""Typed, ranged reads of configuration values and flags: one place that decides what
a bad value is and says so.

Each check returns the value as a plain Python number/bool/str or raises an
:class:`~graphcp.errors.InputError` subclass whose message names where the value came
from (a file, a config class, a flag), the key, the value, and what was expected:
``config.json: num_hidden_layers must be an integer in [1, 4096], got 'two'``.
No torch here: the tuner uses these without the runtime.
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path
from typing import Any, Iterable

from graphcp.errors import ConfigError, InputError

#: sane upper bounds: far above any real model or deployment, low enough that a
#: typo fails here instead of in an allocation or an int64 overflow
MAX_TOKENS = 2**31 - 1  # a request, a context, a KV pool (page ids are int32)
MAX_CP = 1024
#: the most decoder layers a model (and so a pipeline) may have
MAX_LAYERS = 4096
# RuntimeConfig's fields (and their flags, checked before torch is imported)
MAX_PAGE_SIZE = 4096
MAX_REQUESTS = 1 << 16
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_TFLOPS = 1e6  # far above any accelerator
MAX_GB_PER_S = 1e6
MAX_MICROBATCHES = 4096
#: the decode batch sizes a decode graph is captured for by default (docs/decode.md)
DEFAULT_DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_DECODE_BUCKETS = 64


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def _fail(err: type, where: str | None, key: str, expected: str, value: Any) -> InputError:
    return err(f"{where + ': ' if where else ''}{key} must be {expected}, got {_short(value)}")


def _bounds(err: type, where: str | None, key: str, v: float, value: Any, lo, hi, lo_open: bool = False) -> None:
    """Name the bound that was crossed (the low one, or the high one)."""
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise _fail(err, where, key, f"{'>' if lo_open else '>='} {lo}", value)
    if hi is not None and v > hi:
        raise _fail(err, where, key, f"<= {hi}", value)


def check_int(value: Any, key: str, *, lo: int | None = None, hi: int | None = None, where: str | None = None,
              err: type = ConfigError) -> int:
    # bool is an int subclass, but JSON true is not a size; 4096.0 is not an integer either
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(err, where, key, "an integer", value)
    v = int(value)
    _bounds(err, where, key, v, value, lo, hi)
    return v


def check_float(value: Any, key: str, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                where: str | None = None, err: type = ConfigError) -> float:
    """A finite real number (NaN and inf fail every range check silently, so they are
    refused outright)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(err, where, key, "a number", value)
    v = float(value)
    if not math.isfinite(v):
        raise _fail(err, where, key, "a finite number", value)
    _bounds(err, where, key, v, value, lo, hi, lo_open)
    return v


def check_bool(value: Any, key: str, *, where: str | None = None, err: type = ConfigError) -> bool:
    if not isinstance(value, bool) and type(value).__name__ != "bool_":  # numpy's bool too
        raise _fail(err, where, key, "true or false", value)
    return bool(value)


def check_str(value: Any, key: str, *, where: str | None = None, err: type = ConfigError) -> str:
    if not isinstance(value, str):
        raise _fail(err, where, key, "a string", value)
    return value


def check_choice(value: Any, key: str, choices: Iterable[str], *, where: str | None = None,
                 err: type = ConfigError) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise _fail(err, where, key, "one of " + ", ".join(repr(c) for c in choices), value)
    return value


def check_layer_list(value: Any, key: str, num_layers: int, *, err: type = ConfigError) -> tuple[int, ...]:
    """A list of distinct decoder-layer indices in ``[0, num_layers)``, as a tuple (in
    the order given: it is the order of the outputs)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise err(f"{key} must be a list of decoder layer indices, got {_short(value)}")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= int(v) < num_layers:
            raise err(f"{key}[{i}] must be a decoder layer index in [0, {num_layers}), got {_short(v)}")
        if int(v) in out:
            raise err(f"{key} lists layer {int(v)} twice ({_short(list(value))}); expected distinct layers")
        out.append(int(v))
    return tuple(out)
def check_turns(lengths: Iterable[int], where: str, err: type = InputError) -> None:
    """A conversation's turns, by their token counts, each hold a prompt token: an empty
    turn would only generate on after the last, a slip rather than a turn (the file's
    and ``PrefillEngine.generate``'s one rule)."""
    empty = next((i for i, n in enumerate(lengths) if n == 0), None)
    if empty is not None:
        raise err(f"{where}: turn {empty} is empty (every turn needs a prompt token)")


def check_output_dir(path: str | os.PathLike, flag: str, err: type = InputError) -> Path:
    """Refuse an output folder that cannot be written, before any work is done: a file,
    a missing parent, an unwritable folder. The folder itself may not exist yet (it is
    created when the run writes into it)."""
    p = Path(path)
    if str(path) == "":
        raise err(f"{flag}: expected a folder path, got ''")
    if p.exists() and not p.is_dir():
        raise err(f"{flag} {str(path)!r} is a file; expected a folder")
    where = p if p.exists() else p.parent
    if not where.is_dir():
        raise err(f"{flag} {str(path)!r}: folder {str(where)!r} does not exist")
    if not os.access(where, os.W_OK | os.X_OK):
        raise err(f"{flag} {str(path)!r}: cannot create files in {str(where)!r}")
    return p


def check_output_path(path: str | os.PathLike, flag: str, err: type = InputError) -> Path:
    """Refuse an output path that cannot be written, before any work is done: a
    missing folder, a path naming a folder, an unwritable file or folder. Nothing is
    created (an old file stays as it is until the run succeeds)."""
    p = Path(path)
    if str(path) == "" or p.is_dir():
        raise err(f"{flag} {str(path)!r} is a folder; expected a file path")
    parent = p.parent
    if not parent.exists():
        raise err(f"{flag} {str(path)!r}: folder {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise err(f"{flag} {str(path)!r}: {str(parent)!r} is not a folder")
    if p.exists() and not os.access(p, os.W_OK):
        raise err(f"{flag} {str(path)!r}: the file is not writable")
    if not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise err(f"{flag} {str(path)!r}: cannot create files in {str(parent)!r}")
    return p
