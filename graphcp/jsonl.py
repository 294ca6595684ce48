"""Reading JSONL input files (requests, workloads) line by line, every failure named
by file and line: unreadable files, bytes that are not UTF-8, lines that are not JSON
(numbers too long to parse and nesting too deep included). No torch here."""

from __future__ import annotations

import json
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
