"""REQUESTS.jsonl: one request a line, ``{"tokens": [ids...], "prefix": K}``.

``prefix`` (default 0) says the first K tokens were prefilled in an earlier
forward; the rest extends that cached prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphcp.errors import InputError
from graphcp.jsonl import read_jsonl
from graphcp.runtime.batch import check_vocabulary

#: token ids must fit int64 (the vocabulary check, which names the position, comes later)
_ID_RANGE = (-(2**63), 2**63 - 1)


class RequestFileError(InputError):
    """A malformed REQUESTS.jsonl; the message names the file and line."""


@dataclass(frozen=True)
class FileRequest:
    tokens: list[int]
    prefix: int = 0
    where: str = ""  # "FILE line N", for errors found later

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prefix:]


def parse_lines(path: str | Path, parse_line: Callable[[str, dict], Any]) -> list:
    """Each line of a request file read by ``parse_line(where, line)``; an empty file is refused."""
    p = Path(path)
    out = [parse_line(where, d) for where, d in read_jsonl(p, RequestFileError, "request file")]
    if not out:
        raise RequestFileError(f"{p}: no requests (empty batch)")
    return out


def parse_requests(path: str | Path) -> list[FileRequest]:
    return parse_lines(path, request_line)


def token_list(where: str, toks, key: str = "tokens") -> list[int]:
    """A line's list of integer token ids (each fits 64 bits), or RequestFileError naming the line."""
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        raise RequestFileError(f'{where}: "{key}" must be a list of integer ids')
    lo, hi = _ID_RANGE
    bad = next((i for i, t in enumerate(toks) if not lo <= t <= hi), None)
    if bad is not None:
        raise RequestFileError(f"{where}: token id {toks[bad]} at position {bad} does not fit 64 bits")
    return toks


def request_line(where: str, d) -> FileRequest:
    """One request line, ``{"tokens": [ids...], "prefix": K}``, checked (RequestFileError naming the line)."""
    if isinstance(d, dict) and "tokens" not in d and "extend" in d:  # the other JSONL format graphcp reads
        raise RequestFileError(f'{where}: this looks like a `graphcp tune` workload ("extend" lengths a batch, '
                               'workloads/README.md), not a request file: expected {"tokens": [ids...], '
                               '"prefix": K} a line (examples/requests.jsonl)')
    if not isinstance(d, dict) or "tokens" not in d:
        raise RequestFileError(f'{where}: expected an object with "tokens" (and optionally "prefix")')
    toks, prefix = token_list(where, d["tokens"]), d.get("prefix", 0)
    if not toks:
        raise RequestFileError(f"{where}: empty request (no tokens)")
    if not isinstance(prefix, int) or isinstance(prefix, bool) or prefix < 0:
        raise RequestFileError(f'{where}: "prefix" must be an integer >= 0, got {prefix!r}')
    if prefix >= len(toks):
        raise RequestFileError(
            f"{where}: prefix {prefix} is not shorter than the request's {len(toks)} tokens "
            "(at least one token must be new)"
        )
    unknown = set(d) - {"tokens", "prefix"}
    if unknown:
        raise RequestFileError(f"{where}: unknown keys {sorted(unknown)}")
    return FileRequest(toks, prefix, where)


def check_request_vocabulary(reqs: list[FileRequest], vocab_size: int) -> None:
    """The prefill's vocabulary check, before any rank starts, naming the file and line."""
    check_vocabulary([np.asarray(r.tokens, dtype=np.int64) for r in reqs], vocab_size, lambda j: reqs[j].where)
