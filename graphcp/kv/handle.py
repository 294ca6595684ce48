"""What a cache hands out and refuses with: a request's handle (:class:`KVHandle`), what
its placement says about where the request's positions are (:class:`Holding`), and the
two errors of a reservation (:class:`KVCacheFull`, :class:`KVHandleError`).

A handle is the same object whatever the cache mode: the mode's own record of the
request (a token-sharded cache's ledger entry, graphcp.kv.placement.sharded) rides in
``holding``, which only that mode builds and reads, and answers :meth:`KVHandle.positions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from graphcp.errors import BatchError


class KVCacheFull(BatchError, RuntimeError):
    """Not enough free pages (or state slots) for a batch; the pool is unchanged. A
    BatchError (and, as before, a RuntimeError). ``setting``: the RuntimeConfig field
    that sizes what is full (``kv_tokens``, ``state_slots``; None: nothing to raise),
    which the message advises raising: by its API name, or by the flag that set it
    (:meth:`naming`, the command line)."""

    def __init__(self, message: str, setting: str | None = None) -> None:
        super().__init__(message, setting)  # (both: a rank's error is pickled to the launcher)
        self.message, self.setting = message, setting

    def __str__(self) -> str:
        return self.naming(f"RuntimeConfig.{self.setting}")

    def naming(self, name: str) -> str:
        """The message advising to raise ``name`` (the setting, as the caller set it)."""
        return self.message if self.setting is None else f"{self.message}; raise {name}"


class KVHandleError(BatchError):
    """A prefix handle the cache refuses: released, stale (extended since), given twice
    in one batch, not a handle, or issued by another cache. Nothing was changed."""


class Holding(Protocol):
    """Which of a request's ``num_tokens`` positions each rank holds (a placement's view
    of one request, carried by its handle)."""

    def local_tokens(self, num_tokens: int, rank: int) -> int: ...

    def positions(self, num_tokens: int, rank: int) -> np.ndarray: ...


@dataclass(frozen=True)
class EveryPosition:
    """Every rank holds every position at its own local index (a replicated or a
    layer-split cache: what a handle says unless its placement says otherwise)."""

    def local_tokens(self, num_tokens: int, rank: int) -> int:
        return num_tokens

    def positions(self, num_tokens: int, rank: int) -> np.ndarray:
        return np.arange(num_tokens, dtype=np.int64)


EVERY_POSITION = EveryPosition()


@dataclass(frozen=True)
class KVHandle:
    """A request's cached KV as of one forward: pass it as the prefix of the next chunk,
    to the engine (cache) that returned it.

    ``num_tokens`` counts the request's positions (0 .. num_tokens - 1), whichever
    rank holds them. ``pages`` are this rank's pages, in local order: local index
    ``i`` lives at offset ``i % page_size`` of ``pages[i // page_size]``; handles of
    one request differ across ranks in ``pages`` only. Which positions the local
    indices hold: :meth:`positions`.
    """

    seq_id: int
    num_tokens: int
    pages: tuple[int, ...]
    #: the identity of the cache that issued it: a handle from another engine is
    #: refused even when its seq_id and token count match a live sequence here
    cache_id: str = ""
    #: where the request's positions are, as the issuing cache's placement records it
    holding: Holding = EVERY_POSITION

    def local_tokens(self, rank: int) -> int:
        """How many of the request's positions rank ``rank`` holds."""
        return self.holding.local_tokens(self.num_tokens, rank)

    def positions(self, rank: int) -> np.ndarray:
        """int64: the absolute positions rank ``rank`` holds, in its local order
        (increasing): entry ``i`` is at local index ``i`` (see the class doc)."""
        return self.holding.positions(self.num_tokens, rank)
