"""The checks of the prefix handles a batch gives: live, current, this cache's and each
given once. What "current" means is the placement's (the tokens it records for a
request, on whichever rank they are); the rest is the allocator's (its cache id and
live sequences). Array checks over the batch; handles are checked one by one only to
word an error."""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import Callable

import numpy as np

from graphcp.kv.allocator import PageAllocator
from graphcp.kv.handle import KVHandle, KVHandleError

_seq_id_of = attrgetter("seq_id")
_cache_id_of = attrgetter("cache_id")
_num_tokens_of = attrgetter("num_tokens")


class HandleCheck:
    """``request_tokens(rows)``: int64, the positions each live sequence in these table
    rows holds over every rank (what their handles' ``num_tokens`` say)."""

    def __init__(self, allocator: PageAllocator, request_tokens: Callable[[np.ndarray], np.ndarray]) -> None:
        self.allocator, self.request_tokens = allocator, request_tokens

    def check_handle(self, handle: KVHandle) -> None:
        """KVHandleError unless ``handle`` is a live, current handle issued by this cache."""
        if not isinstance(handle, KVHandle):
            raise KVHandleError(f"a prefix must be a KVHandle returned by this engine (or None), "
                                f"got {type(handle).__name__} {handle!r}"[:200])
        if handle.cache_id != self.allocator.cache_id:
            raise KVHandleError(f"KV handle seq_id={handle.seq_id} was issued by another KV cache (another engine); "
                                "pass a handle only to the engine that returned it")
        row = self.allocator.table.live().get(handle.seq_id)
        if row is None:
            raise KVHandleError(f"KV handle seq_id={handle.seq_id} is not live (released, or its forward failed)")
        total = int(self.request_tokens(np.array([row]))[0])
        if total != handle.num_tokens:
            raise KVHandleError(
                f"KV handle seq_id={handle.seq_id} is stale: it holds {handle.num_tokens} tokens, "
                f"the cache now holds {total} (it was extended since)"
            )

    def prefix_rows(self, prefixes: "list[KVHandle | None]") -> np.ndarray | None:
        """int64 [len(prefixes)]: each prefix's row of the dense table, -1 for None (a new
        sequence); None when every entry is None. KVHandleError (as :meth:`check_handle`
        words it, or naming a handle given twice) unless every handle is live, current,
        this cache's and given once."""
        nones = prefixes.count(None)
        if nones == len(prefixes):
            return None
        given = list(map(is_not, prefixes, repeat(None))) if nones else None  # True where a handle is given
        handles = list(compress(prefixes, given)) if nones else prefixes
        rows = self._handle_rows(handles)
        if rows is None:
            self._check_each(handles)  # raises, naming what is wrong
            live = self.allocator.table.live()
            rows = np.fromiter(map(live.__getitem__, map(_seq_id_of, handles)), np.int64, len(handles))
        if not nones:  # every entry a handle (a decode step's)
            return rows
        out = np.full(len(prefixes), -1, dtype=np.int64)
        out[np.fromiter(given, bool, len(given))] = rows
        return out

    def _handle_rows(self, handles: list) -> np.ndarray | None:
        """The rows of ``handles`` when all are live, current, this cache's and distinct;
        None otherwise (:meth:`_check_each` then says why)."""
        if set(map(type, handles)) != {KVHandle} or set(map(_cache_id_of, handles)) != {self.allocator.cache_id}:
            return None
        ids = list(map(_seq_id_of, handles))
        if len(set(ids)) != len(ids):
            return None
        found = list(map(self.allocator.table.live().get, ids, repeat(-1)))  # (plain ints: cheaper than arrays)
        if -1 in found:
            return None
        rows = np.array(found, dtype=np.int64)
        if self.request_tokens(rows).tolist() != list(map(_num_tokens_of, handles)):
            return None
        return rows

    def _check_each(self, handles: list) -> None:
        """The handle checks one by one: raises on the first bad or repeated handle."""
        seen: set[int] = set()
        for h in handles:
            self.check_handle(h)
            if h.seq_id in seen:
                raise KVHandleError(f"KV handle seq_id={h.seq_id} is the prefix of two requests in one batch")
            seen.add(h.seq_id)
