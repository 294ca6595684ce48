"""REQUESTS.jsonl: one request a line, ``{"tokens": [ids...], "prefix": K}``; what
``graphcp generate`` reads besides, conversations, ``{"turns": [[ids...], ...],
"max_new_tokens": N}``.

``prefix`` (default 0) says the first K tokens were prefilled in an earlier
forward; the rest extends that cached prefix. No torch here: the files are read and
checked before anything heavy is imported (:mod:`graphcp.cli.inputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphcp.checks import check_turns
from graphcp.errors import InputError
from graphcp.jsonl import CONVERSATION, REQUEST, LineFormat, expected_lines, read_jsonl, wrong_line

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


def request_line(where: str, d, accepted: Sequence[LineFormat] = (REQUEST,)) -> FileRequest:
    """One request line, ``{"tokens": [ids...], "prefix": K}``, checked (RequestFileError
    naming the line; ``accepted``: the formats the file may hold, which a refusal names)."""
    if not isinstance(d, dict) or "tokens" not in d:
        raise RequestFileError(wrong_line(where, d, accepted))
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
    check_known_keys(where, d, REQUEST, accepted)
    return FileRequest(toks, prefix, where)


def check_context(where: str, prompt: int, context: int, turns: int = 1, most: int = 0) -> None:
    """A line's prompt tokens, and the ``most`` tokens each of its ``turns`` may generate,
    within the model's context (what a rank would refuse as ``request j``, named by line)."""
    if prompt + turns * most > context:
        made = f" and up to {turns} x {most} generated" if most else ""
        raise RequestFileError(f"{where}: {prompt} prompt tokens{made} exceed the model's context of {context}")


def check_known_keys(where: str, d: dict, fmt: LineFormat, accepted: Sequence[LineFormat]) -> None:
    """A line of ``fmt`` holds only its keys (a misspelt one is refused, named)."""
    unknown = set(d) - {fmt.key, *fmt.optional}
    if unknown:
        raise RequestFileError(f"{where}: unknown keys {sorted(unknown)}: expected {expected_lines(accepted)}")


@dataclass(frozen=True)
class FileConversation:
    """A line of ``graphcp generate``'s file: a conversation, or a request (one turn)."""

    turns: list[list[int]]
    max_new_tokens: int | None = None
    prefix: int = 0
    where: str = ""


def conversation_line(where: str, d) -> FileConversation:
    """One line: a request (one turn) or ``{"turns": [...], "max_new_tokens": N}``."""
    accepted = (REQUEST, CONVERSATION)
    if not isinstance(d, dict) or "turns" not in d:
        r = request_line(where, d, accepted)
        return FileConversation([r.tokens], None, r.prefix, where)
    turns, most = d["turns"], d.get("max_new_tokens")
    if not isinstance(turns, list) or not turns:
        raise RequestFileError(f'{where}: "turns" must be a non-empty list of token-id lists')
    turns = [token_list(where, t, f"turns[{i}]") for i, t in enumerate(turns)]
    check_turns([len(t) for t in turns], where, RequestFileError)
    if most is not None and (not isinstance(most, int) or isinstance(most, bool) or most < 1):
        raise RequestFileError(f'{where}: "max_new_tokens" must be an integer >= 1, got {most!r}')
    check_known_keys(where, d, CONVERSATION, accepted)
    return FileConversation(turns, most, 0, where)


def parse_conversations(path: str | Path) -> list[FileConversation]:
    return parse_lines(path, conversation_line)


def kv_files(folder: str | Path) -> list[Path]:
    """``folder/0.safetensors``, ``1.safetensors``, ... (what ``graphcp prefill --export-kv``
    writes), in request order; InputError naming the folder when it holds none, or a gap."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"--import-kv {folder}: not a folder")
    found = {p.stem: p for p in folder.glob("*.safetensors")}
    if not found:
        raise InputError(f"--import-kv {folder}: no <i>.safetensors file (what graphcp prefill --export-kv writes)")
    files = []
    while str(len(files)) in found:
        files.append(found.pop(str(len(files))))
    if found:
        raise InputError(f"--import-kv {folder}: {sorted(found)[0]}.safetensors does not follow 0.safetensors .. "
                         f"{len(files) - 1}.safetensors (one file a request, numbered from 0)")
    return files
