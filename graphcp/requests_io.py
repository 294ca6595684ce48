"""REQUESTS.jsonl: one request a line, ``{"tokens": [ids...], "prefix": K}``.

``prefix`` (default 0) says the first K tokens were prefilled in an earlier
forward; the rest extends that cached prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class RequestFileError(ValueError):
    pass


@dataclass(frozen=True)
class FileRequest:
    tokens: list[int]
    prefix: int = 0

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prefix:]


def parse_requests(path: str | Path) -> list[FileRequest]:
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise RequestFileError(f"cannot read {p}: {e}") from None
    out: list[FileRequest] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{p.name} line {n}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestFileError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(d, dict) or "tokens" not in d:
            raise RequestFileError(f'{where}: expected an object with "tokens" (and optionally "prefix")')
        toks, prefix = d["tokens"], d.get("prefix", 0)
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise RequestFileError(f'{where}: "tokens" must be a list of integer ids')
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
        out.append(FileRequest(toks, prefix))
    if not out:
        raise RequestFileError(f"{p}: no requests (empty batch)")
    return out
