"""Reading JSONL input files (requests, conversations, workloads) line by line, every
failure named by file and line: unreadable files, bytes that are not UTF-8, lines that
are not JSON (numbers too long to parse and nesting too deep included); and the formats
themselves, so that a line of one given where another is read says which it is
(:func:`wrong_line`). No torch here."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from graphcp.errors import InputError

#: JSON numbers longer than this are refused before Python parses them (ints of
#: thousands of digits are slow to convert and never a length or a token id)
_MAX_NUMBER_DIGITS = 40


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_NUMBER_DIGITS:
        raise ValueError(f"number {text[:20]}... has {len(text)} digits")
    return int(text)


def read_jsonl(path: str | Path, err: type[InputError], what: str = "file") -> Iterator[tuple[str, Any]]:
    """Yield ``(where, value)`` for every non-blank line; ``where`` names the file as
    given and the line, one way for every input file: ``data/reqs.jsonl line 2``.
    Raises ``err``."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise err(f"cannot read {what} {p}: {e.strerror or e}") from None
    # bytes.splitlines: the line numbers an editor shows (\n, \r\n or \r)
    for n, raw in enumerate(data.splitlines(), start=1):
        at = f"{p} line {n}"
        try:
            line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a leading BOM is not content
        except UnicodeDecodeError as e:
            raise err(f"{at}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
        if not line.strip():
            continue
        try:
            value = json.loads(line, parse_int=_parse_int)
        except json.JSONDecodeError as e:
            raise err(f"{at}: not valid JSON ({e.msg} at column {e.colno})") from None
        except (ValueError, RecursionError) as e:  # an over-long number, nesting too deep
            raise err(f"{at}: not valid JSON ({type(e).__name__}: {e})") from None
        yield at, value


@dataclass(frozen=True)
class LineFormat:
    """One of the JSONL formats graphcp reads, a line at a time."""

    key: str  # the key a line of it must hold
    optional: tuple[str, ...]  # the keys it may hold besides
    shape: str  # a line, as the docs write it
    doc: str  # where it is described (or an example file)
    looks: str  # what a line of it is, said to whoever gave it to the wrong command


REQUEST = LineFormat("tokens", ("prefix",), '{"tokens": [ids...], "prefix": K}', "examples/requests.jsonl",
                     'a request file ("tokens" ids a line: `graphcp prefill` or `generate` reads it)')
CONVERSATION = LineFormat("turns", ("max_new_tokens",), '{"turns": [[ids...], ...], "max_new_tokens": N}',
                          "docs/cli.md", 'a conversation ("turns": `graphcp generate` reads it)')
WORKLOAD = LineFormat("extend", ("prefix",), '{"extend": [...], "prefix": [...]}', "workloads/README.md",
                      'a `graphcp tune` workload ("extend" lengths a batch, workloads/README.md)')
LINE_FORMATS = (REQUEST, CONVERSATION, WORKLOAD)


def expected_lines(accepted: Sequence[LineFormat]) -> str:
    """``{"tokens": [ids...], "prefix": K} a line (examples/requests.jsonl)``: what a file of
    ``accepted`` lines holds."""
    return (f"{' or '.join(f.shape for f in accepted)} a line "
            f"({', '.join(dict.fromkeys(f.doc for f in accepted))})")


def other_format(value: Any, accepted: Sequence[LineFormat]) -> LineFormat | None:
    """The format of graphcp's other JSONL files a line is (by the key it holds), if it is
    none of ``accepted``'s."""
    if not isinstance(value, dict) or any(f.key in value for f in accepted):
        return None
    return next((f for f in LINE_FORMATS if f.key in value), None)


def wrong_line(where: str, value: Any, accepted: Sequence[LineFormat]) -> str:
    """Why a line holding none of ``accepted``'s keys is refused: another of graphcp's
    formats (say which, and who reads it), unknown keys (named), or keys missing."""
    expected = expected_lines(accepted)
    keys = " or ".join(f'"{f.key}"' for f in accepted)
    other = other_format(value, accepted)
    if other is not None:
        return f"{where}: this looks like {other.looks}: expected {expected}"
    if not isinstance(value, dict):
        return f"{where}: expected an object with {keys}, got {type(value).__name__}: {expected}"
    unknown = sorted(set(value) - {k for f in accepted for k in (f.key, *f.optional)})
    if unknown:
        return f"{where}: unknown keys {unknown}: expected {expected}"
    return f"{where}: expected an object with {keys}: {expected}"
