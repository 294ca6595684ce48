"""The worker's lines: one JSON object a line each way (docs/pd.md, "serve-prefill").

A request: ``{"id": "r-17", "decode": ADDRESS, "tokens": [ids...]}`` (``decode``: a
folder for the file transport, a Mooncake receiver's ``host:port``); ``{"op": "status"}``
asks for the worker's state. A reply: ``{"id": ..., "ok": true, ...times and bytes}`` or
``{"id": ..., "ok": false, "stage": ..., "error": "one line"}``. No torch here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from graphcp.errors import one_line

#: a request id: it names the file the file transport writes (``DIR/<id>.safetensors``)
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: the longest line read; a longer one is refused and skipped to its end
MAX_LINE = 8 << 20
REQUEST_KEYS = ("id", "decode", "tokens")
#: the stage a refusal or failure came at (``stage`` of an error reply)
REFUSED, PREFILL, TRANSFER, STOPPED = "refused", "prefill", "transfer", "stopped"


class RequestError(ValueError):
    """A line the worker refuses; ``request_id`` the line's id when it had a usable one."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class Limits:
    """What a request may hold: ids below ``vocab_size``, at most ``max_tokens``
    (``why``: what sets that bound, for the refusal)."""

    vocab_size: int
    max_tokens: int
    why: str


@dataclass
class ServeRequest:
    id: str
    decode: str
    tokens: np.ndarray  # int64
    arrived: float = 0.0  # time.monotonic() when admitted


def parse_line(line: bytes) -> dict:
    """The JSON object of one line (RequestError: not UTF-8 JSON, or not an object)."""
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RequestError(f"not a JSON line ({one_line(e)})") from None
    if not isinstance(obj, dict):
        raise RequestError(f'expected a JSON object such as {{"id": "r1", "decode": "DIR", "tokens": [1, 2]}}, '
                           f"got a {type(obj).__name__}")
    return obj


def parse_request(obj: dict, limits: Limits) -> ServeRequest:
    """``obj`` as a request, checked against ``limits`` (RequestError naming the field)."""
    rid = obj.get("id")
    good_id = rid if isinstance(rid, str) and ID_PATTERN.fullmatch(rid) else None
    unknown = sorted(set(obj) - set(REQUEST_KEYS))
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r} (a request has {', '.join(REQUEST_KEYS)})", good_id)
    if good_id is None:
        raise RequestError(f"id must be a string of letters, digits, '.', '_', '-' (at most 128, not starting "
                           f"with '.', '_' or '-'), got {rid!r}")
    decode = obj.get("decode")
    if not isinstance(decode, str) or not decode:
        raise RequestError(f"decode must name the decode side's address (a folder, or host:port), got {decode!r}",
                           rid)
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise RequestError(f"tokens must be a non-empty list of token ids, got {_short(tokens)}", rid)
    if not all(type(t) is int for t in tokens):
        bad = next(t for t in tokens if type(t) is not int)
        raise RequestError(f"tokens must be integers, got {_short(bad)}", rid)
    if len(tokens) > limits.max_tokens:
        raise RequestError(f"oversized: {len(tokens)} tokens, this worker takes at most {limits.max_tokens} "
                           f"({limits.why})", rid)
    ids = np.asarray(tokens, dtype=np.int64) if max(map(abs, tokens)) < 2 ** 63 else None
    if ids is None or ids.min() < 0 or ids.max() >= limits.vocab_size:
        bad = next(t for t in tokens if not 0 <= t < limits.vocab_size)
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})", rid)
    return ServeRequest(rid, decode, ids)


def _short(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, np.ndarray) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def error_reply(request_id: str | None, stage: str, message: object) -> dict:
    return {"id": request_id, "ok": False, "stage": stage, "error": one_line(message)}


def encode(reply: dict) -> bytes:
    return (json.dumps(reply) + "\n").encode()
