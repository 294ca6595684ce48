"""Paged KV cache: one pool tensor for all layers, a page allocator, and
per-request page tables and slot mappings.

Memory layout
-------------
``pool`` is one tensor ``[num_layers, num_pages, 2, *page]`` where index 0/1 of
the third dimension is K/V and ``page`` is

- ``NHD``: ``[page_size, num_kv_heads, head_dim]`` (FlashInfer's default), or
- ``HND``: ``[num_kv_heads, page_size, head_dim]`` (what trtllm-gen reads).

``pool[layer]`` is the ``[num_pages, 2, *page]`` tensor the attention backends
take. Token position ``p`` of a request lives in page ``pages[p // page_size]``
at offset ``p % page_size``; its *slot* is ``page * page_size + offset``.

Page 0 is the scratch page: it is never handed to a request, so a write aimed at
slot -1 (padding) can be redirected to slot 0 and keep the write's shape static.

Page table
----------
The allocator keeps one dense ``int32`` table ``[rows, max_pages_per_seq]``: each live
sequence owns a row holding its pages followed by the scratch page. The table *is*
the page lists (with each row's page and token counts beside it), so the per-forward
:meth:`PagedKVCache.page_table` is one numpy gather, not a Python loop per request.
Rows are recycled; when too few are free the table doubles its rows.

A batch is reserved and undone whole: :meth:`PagedKVCache.extend` takes all the
batch's new pages off the free stack in one slice and writes them into the table
rows in one scattered assignment; :meth:`PagedKVCache.rollback` gathers them back
the same way. The free pages are a stack (a numpy array and its height), so the
order of the free list after a rollback is exactly what it was before the extend.

What a rank holds
-----------------
A replicated cache (the all-gather exchange) holds every position of a request on
every rank: local index = position. A token-sharded cache
(:class:`graphcp.kv.sharded.ShardedKVCache`) holds on rank ``r`` only the positions
of its own zigzag blocks of every forward that wrote the request, in increasing
order: :meth:`KVHandle.positions` lists them, and local index ``i`` is the slot
``pages[i // page_size] * page_size + i % page_size`` of that rank's pool. Every
rank derives every other rank's holdings from the handle (``chunks``) alone.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import ClassVar

import numpy as np
import torch

from graphcp.cp.zigzag import ZigzagLayout
from graphcp.errors import BatchError
from graphcp.jit import host_kernel
from graphcp.kv.decode import EVERY_RANK, DecodeSlots, decoded_positions
from graphcp.kv.layout import KVLayout, kv_cache_views
from graphcp.kv.spans import KVSpan, whole_layer_spans
from graphcp.kv.spec import KVHeads, PoolSpec

SCRATCH_PAGE = 0


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
    #: "replicated" (every rank holds every position) or "sharded" (each rank its zigzag blocks)
    kv_cache: str = "replicated"
    #: the CP group's size when sharded (1 otherwise)
    cp_size: int = 1
    #: sharded: ``(cached, new)`` tokens of every forward that wrote the request, in order;
    #: the zigzag layout of each says which of its positions each rank holds
    chunks: tuple[tuple[int, int], ...] = ()
    #: sharded: how many of the request's positions each rank holds (sums to num_tokens)
    rank_tokens: tuple[int, ...] = ()
    #: sharded: the positions decode steps added, as runs ``(first, count, tokens on each rank
    #: before)`` from which each position's rank follows (graphcp.kv.decode)
    decoded: tuple[tuple[int, int, tuple[int, ...]], ...] = ()

    def local_tokens(self, rank: int) -> int:
        """How many of the request's positions rank ``rank`` holds."""
        return self.rank_tokens[rank] if self.kv_cache == "sharded" else self.num_tokens

    def positions(self, rank: int) -> np.ndarray:
        """int64: the absolute positions rank ``rank`` holds, in its local order
        (increasing): entry ``i`` is at local index ``i`` (see the class doc)."""
        if self.kv_cache != "sharded":
            return np.arange(self.num_tokens, dtype=np.int64)
        layout = ZigzagLayout(self.cp_size)
        out = []
        for cached, new in self.chunks:
            start, length = layout.plan([new], [cached]).blocks()
            for s, n in zip(start[rank, 0].tolist(), length[rank, 0].tolist()):
                out.append(np.arange(s, s + n, dtype=np.int64))
        if self.decoded:  # decoded tokens lie between the chunks: local order is position order
            out.append(decoded_positions(self.decoded, rank))
            return np.sort(np.concatenate(out))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


_INITIAL_ROWS = 16


@dataclass(slots=True)
class _Reservation:
    """What one :meth:`PagedKVCache.extend` changed, to undo it without recomputing."""

    ids: list[int]  # the sequence ids it returned (a copy)
    new: np.ndarray  # the new tokens it reserved (read-only: the caller's when it was, else a copy)
    rows: np.ndarray  # the requests' table rows
    need: int  # pages it took off the free stack
    before: np.ndarray  # [2, R]: each row's tokens and pages before (0 for a new sequence)
    created: list[bool] | None  # which requests it made a new sequence for (None: all)

    def undoes(self, seq_ids) -> bool:
        """Whether a rollback of ``seq_ids`` is this extend's (the same ids, in order)."""
        return type(seq_ids) is list and seq_ids == self.ids


def _frozen_copy(a: np.ndarray) -> np.ndarray:
    out = a.copy()
    out.setflags(write=False)
    return out


_seq_id_of = attrgetter("seq_id")
_cache_id_of = attrgetter("cache_id")
_num_tokens_of = attrgetter("num_tokens")


class PagedKVCache:
    """The replicated cache mode (every rank holds every request's KV), and the base of
    every cache mode: a cache class is its mode's object (graphcp.kv.factory builds it).
    What a mode owns: the reservation and rollback (:meth:`reserve`, :meth:`rollback`,
    :meth:`release`), what a rank holds and exports (:meth:`kv_spans`, :meth:`local_index`),
    the prefix fetch before a layer's attention (:meth:`fetch_prefix`), and the
    exchange its layers store and attend through (:attr:`exchange`, the name of an
    exchange in ``graphcp.attention.kv_exchange``: ``all-gather`` writes every rank's rows
    here, ``ring`` keeps a rank's own)."""

    #: the cache mode (RuntimeConfig.kv_cache) this class is
    mode: ClassVar[str] = "replicated"
    #: how a forward's layers store their K/V and attend (graphcp.attention.kv_exchange)
    exchange: ClassVar[str] = "all-gather"

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        layout: KVLayout = "NHD",
        max_pages_per_seq: int | None = None,
        first_layer: int = 0,
    ) -> None:
        """``first_layer``: the global index of the pool's first layer (a pipeline
        stage caches its own layers only; :meth:`layer` takes global indices)."""
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if layout not in ("NHD", "HND"):
            raise ValueError(f"layout must be 'NHD' or 'HND', got {layout!r}")
        if max_pages_per_seq is None:
            max_pages_per_seq = num_pages - 1
        if max_pages_per_seq < 1:
            raise ValueError(f"max_pages_per_seq must be >= 1, got {max_pages_per_seq}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.first_layer = first_layer
        self._page_shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else None
        self.num_kv_heads, self.head_dim, self.layout = num_kv_heads, head_dim, layout
        self.pool = self._allocate_pool(dtype, device)
        self._layer_views: tuple = (None, ())  # (the pool they view, its layers)
        # the free pages, a LIFO stack: _free[:_num_free], top last (recently freed
        # pages are reused first: warm in cache); page 1 is handed out first
        self._free = np.arange(num_pages - 1, SCRATCH_PAGE, -1, dtype=np.int32)
        self._num_free = num_pages - 1
        self._rows: dict[int, int] = {}  # live sequence id -> its row of the dense table (read: _live_rows)
        self._pending: tuple[list[int], np.ndarray] | None = None  # (ids, rows) not yet in _rows
        self._next_id = 0
        self.cache_id = uuid.uuid4().hex  # stamped on every handle this cache issues
        # the dense page table, and per row its sequence's page and token counts (0 when free)
        self._table = np.full((_INITIAL_ROWS, max_pages_per_seq), SCRATCH_PAGE, dtype=np.int32)
        self._table_view = np.zeros(0, dtype=np.int32)  # the read-only view :attr:`table` hands out (on first use)
        self._row_pages = np.zeros(_INITIAL_ROWS, dtype=np.int64)
        self._row_tokens = np.zeros(_INITIAL_ROWS, dtype=np.int64)
        self._last: _Reservation | None = None  # the last extend, while nothing else changed
        # the free table rows, a LIFO stack like the pages': _free_rows[:_num_free_rows], low rows first
        self._free_rows = np.arange(_INITIAL_ROWS - 1, -1, -1, dtype=np.int64)
        self._num_free_rows = _INITIAL_ROWS

    # ---- the mode: built and sized by graphcp.kv.factory --------------------------
    @classmethod
    def create(cls, geometry: KVHeads, pool: PoolSpec) -> "PagedKVCache":
        """This mode's cache of ``geometry``'s tokens in ``pool`` (the factory's call)."""
        return cls(len(pool.layers), pool.num_pages, pool.page_size, geometry.num_kv_heads, geometry.head_dim,
                   pool.dtype, pool.device, geometry.layout, pool.max_pages_per_seq, pool.layers.start)

    @classmethod
    def held_layers(cls, pool: PoolSpec) -> int:
        """Layers a rank's pool of this mode holds (here every layer it serves)."""
        return len(pool.layers)

    @classmethod
    def pool_bytes_for(cls, geometry: KVHeads, pool: PoolSpec) -> int:
        """Bytes of rank ``pool.rank``'s pool (what :meth:`create` allocates)."""
        itemsize = torch.empty(0, dtype=pool.dtype).element_size()
        return (cls.held_layers(pool) * pool.num_pages * 2 * pool.page_size * geometry.num_kv_heads
                * geometry.head_dim * itemsize)

    @classmethod
    def capture_bytes_for(cls, pool_bytes: int, num_layers: int, exchange: str) -> int:
        """What capturing the buckets reserves for this mode besides the pool: nothing."""
        return 0

    def rows_bound(self, cp_size: int) -> int:
        """The most rows one forward can give a rank: its share of a pool's worth of tokens."""
        return -(-self.num_pages * self.page_size // cp_size)

    def prefix_pages(self, prefixes: "list[KVHandle | None]") -> np.ndarray | None:
        """The cached-prefix pages a forward must fetch before each layer's attention
        (:meth:`fetch_prefix`); None: this cache keeps every layer, nothing to fetch."""
        return None

    def fetch_prefix(self, layer: int, pages, group) -> int:
        """Before ``layer``'s attention, fetch the batch's cached-prefix ``pages`` of it
        from where they are kept; the bytes this rank received. Every layer is here: none."""
        return 0

    def stored_tokens_of(self, layer: int, batch_tokens: int, local_rows: int) -> int:
        """Tokens of a forward's batch (``batch_tokens`` in all, ``local_rows`` of them this
        rank's rows) whose K/V of ``layer`` this rank's cache keeps: every one here."""
        return batch_tokens

    def _allocate_pool(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """The pool (a cache that stores something else per token, a family's own, overrides it)."""
        n, h, d = self.page_size, self.num_kv_heads, self.head_dim
        page = (n, h, d) if self.layout == "NHD" else (h, n, d)
        return torch.zeros((self.num_layers, self.num_pages, 2, *page), dtype=dtype, device=device)

    def token_values(self, layer: int) -> int:
        """Values one token holds in ``layer``'s cache (what the exchange moves a token)."""
        return 2 * self.num_kv_heads * self.head_dim

    def page_pools(self) -> dict[str, torch.Tensor]:
        """Every tensor holding per-page data, pages along dim 1 (the capture self-check
        compares the pages a batch touched in each)."""
        return {"kv_cache": self.pool}

    def state_pools(self) -> dict[str, torch.Tensor]:
        """Every tensor holding per-request state besides the pages (a family's cache that
        keeps a recurrence's state per request, in its folder): none here."""
        return {}

    # ---- capacity -------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool can hold across all requests (scratch page excluded)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _pages(self, tokens: np.ndarray) -> np.ndarray:
        """:meth:`pages_for` of every entry of a non-negative integer array (a new array)."""
        if self._page_shift is not None:  # a power-of-two page: an add and a shift
            out = tokens + (self.page_size - 1)
            out >>= self._page_shift
            return out
        return -(-tokens // self.page_size)

    def layer(self, i: int) -> torch.Tensor:
        """The cache of global decoder layer ``i`` (one view per layer, made once per pool:
        every attention break asks, and slicing the pool costs ~1 us a time)."""
        j = self.local_layer(i)
        pool, views = self._layer_views
        if pool is not self.pool:  # first use, or the pool was replaced
            with torch.inference_mode(False):  # plain views, whichever mode the first call ran in
                pool, views = self._layer_views = (self.pool, self.pool.unbind(0))
        return views[j]

    def local_layer(self, i: int) -> int:
        """The pool index of global decoder layer ``i`` (IndexError when another stage holds it)."""
        j = i - self.first_layer
        if not 0 <= j < self.num_layers:  # a negative index would silently wrap
            raise IndexError(f"layer {i} is not cached here: this KV cache holds layers "
                             f"{self.first_layer}..{self.first_layer + self.num_layers - 1}")
        return j

    @property
    def pool_bytes(self) -> int:
        """Bytes of this rank's page pools (:meth:`page_pools`: every layer it keeps,
        scratch page included)."""
        return sum(t.numel() * t.element_size() for t in self.page_pools().values())

    # ---- export (graphcp.kv.spans.KVSource) --------------------------------------
    def kv_spans(self, handle: KVHandle, cp_size: int) -> list[KVSpan]:
        """Every layer whole; the ranks export contiguous layer ranges (every rank holds all)."""
        return whole_layer_spans(self.num_layers, handle.num_tokens, cp_size, self.first_layer)

    def holds(self, span: KVSpan, rank: int) -> bool:
        return True

    def read_span(self, handle: KVHandle, span: KVSpan) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``handle``'s positions ``[span.start, span.stop)`` of one layer, each
        ``[num_kv_heads, n, head_dim]`` (new contiguous tensors; the cache is not changed).
        The span's positions are consecutive local indices here (a span never crosses
        what another rank holds)."""
        self.check_handle(handle)
        ps = self.page_size
        start = self.local_index(handle, span.start)
        stop = start + span.num_tokens
        first, last = start // ps, self.pages_for(stop)
        pages = torch.tensor(handle.pages[first:last], dtype=torch.long, device=self.pool.device)
        k_pages, v_pages = kv_cache_views(self.layer(span.layer), self.layout)  # [pages, ps, H, D]
        lo, hi = start - first * ps, stop - first * ps
        k = k_pages.index_select(0, pages).flatten(0, 1)[lo:hi]
        v = v_pages.index_select(0, pages).flatten(0, 1)[lo:hi]
        return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()

    def local_index(self, handle: KVHandle, position: int) -> int:
        """Where this pool stores the request's ``position`` (its local index): here every
        position at its own index (a token-sharded pool stores a share, in order)."""
        return position

    @property
    def table_width(self) -> int:
        """Most pages one sequence may hold (the dense table's columns)."""
        return self._table.shape[1]

    @property
    def table(self) -> np.ndarray:
        """The dense ``[rows, table_width]`` int32 page table, as a read-only view. Row
        ``r`` is valid only while its sequence is live; the table is reallocated when it
        grows, so do not hold the view across :meth:`extend`."""
        view = self._table_view
        if view.base is not self._table:  # the table grew: a new view of it
            view = self._table_view = self._table.view()
            view.flags.writeable = False
        return view

    def _grow_rows(self, rows: int) -> None:
        """Make the table (and every per-row array) ``rows`` rows long; new rows free."""
        n, w = self._table.shape
        table = np.full((rows, w), SCRATCH_PAGE, dtype=np.int32)
        table[:n] = self._table
        self._table = table
        self._row_pages = np.concatenate([self._row_pages, np.zeros(rows - n, dtype=np.int64)])
        self._row_tokens = np.concatenate([self._row_tokens, np.zeros(rows - n, dtype=np.int64)])
        # the new rows go under the free ones, handed out low first after them
        free, height = np.empty(rows, dtype=np.int64), self._num_free_rows
        free[: rows - n] = np.arange(rows - 1, n - 1, -1)
        free[rows - n : rows - n + height] = self._free_rows[:height]
        self._free_rows, self._num_free_rows = free, rows - n + height

    def _live_rows(self) -> dict[int, int]:
        """Live sequence id -> table row. An all-new reservation's entries are written on
        the first read after it (by then its forward ran: the handles read them), so a
        batch that is undone before (a failed forward) never writes them: no per-request
        dict work on the path to the first launch."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._rows.update(zip(pending[0], pending[1].tolist()))
        return self._rows

    def _row_of(self, seq_id: int) -> int:
        return self._live_rows()[seq_id]

    def _pages_of_row(self, row: int) -> tuple[int, ...]:
        return tuple(self._table[row, : self._row_pages[row]].tolist())

    # ---- allocation -----------------------------------------------------------
    def check_handle(self, handle: KVHandle) -> None:
        """KVHandleError unless ``handle`` is a live, current handle issued by this cache."""
        if not isinstance(handle, KVHandle):
            raise KVHandleError(f"a prefix must be a KVHandle returned by this engine (or None), "
                                f"got {type(handle).__name__} {handle!r}"[:200])
        if handle.cache_id != self.cache_id:
            raise KVHandleError(f"KV handle seq_id={handle.seq_id} was issued by another KV cache (another engine); "
                                "pass a handle only to the engine that returned it")
        row = self._live_rows().get(handle.seq_id)
        if row is None:
            raise KVHandleError(f"KV handle seq_id={handle.seq_id} is not live (released, or its forward failed)")
        total = int(self._request_tokens(np.array([row]))[0])
        if total != handle.num_tokens:
            raise KVHandleError(
                f"KV handle seq_id={handle.seq_id} is stale: it holds {handle.num_tokens} tokens, "
                f"the cache now holds {total} (it was extended since)"
            )

    def prefix_rows(self, prefixes: "list[KVHandle | None]") -> np.ndarray | None:
        """int64 [len(prefixes)]: each prefix's row of the dense table, -1 for None (a new
        sequence); None when every entry is None. KVHandleError (as :meth:`check_handle`
        words it, or naming a handle given twice) unless every handle is live, current,
        this cache's and given once. Array checks over the batch; the handles are
        checked one by one only to word an error."""
        if prefixes.count(None) == len(prefixes):
            return None
        given = list(map(is_not, prefixes, repeat(None)))  # True where a handle is given
        handles = list(compress(prefixes, given))
        rows = self._handle_rows(handles)
        if rows is None:
            self._check_each(handles)  # raises, naming what is wrong
            rows = np.fromiter(map(self._live_rows().__getitem__, map(_seq_id_of, handles)), np.int64, len(handles))
        out = np.full(len(prefixes), -1, dtype=np.int64)
        out[np.fromiter(given, bool, len(given))] = rows
        return out

    def _handle_rows(self, handles: list) -> np.ndarray | None:
        """The rows of ``handles`` when all are live, current, this cache's and distinct;
        None otherwise (:meth:`_check_each` then says why)."""
        if set(map(type, handles)) != {KVHandle} or set(map(_cache_id_of, handles)) != {self.cache_id}:
            return None
        ids = list(map(_seq_id_of, handles))
        if len(set(ids)) != len(ids):
            return None
        rows = np.fromiter(map(self._live_rows().get, ids, repeat(-1)), np.int64, len(ids))
        if (rows < 0).any():
            return None
        held = np.fromiter(map(_num_tokens_of, handles), np.int64, len(ids))
        if not np.array_equal(self._request_tokens(rows), held):
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

    def _request_tokens(self, rows: np.ndarray) -> np.ndarray:
        """int64: the positions of the live sequences in these rows (what their handles'
        num_tokens say): here all of them are stored; a sharded cache stores a share."""
        return self._row_tokens[rows]

    def extend(self, prefixes: "list[KVHandle | None]", new_tokens) -> list[int]:
        """Reserve room for ``new_tokens[i]`` more tokens after ``prefixes[i]`` (a new
        sequence when None), all or nothing. Returns the sequence ids."""
        if len(prefixes) != len(new_tokens):
            raise ValueError("prefixes and new_tokens must have the same length")
        return self.reserve(prefixes, self.prefix_rows(prefixes), np.asarray(new_tokens, dtype=np.int64))[0]

    def reserve(self, prefixes: "list[KVHandle | None]", rows: np.ndarray | None,
                new: np.ndarray) -> tuple[list[int], np.ndarray]:
        """:meth:`extend` for a caller that has the prefixes' rows already (the batch
        preparer's hot path): ``rows`` is what :meth:`prefix_rows` returned for
        ``prefixes``, nothing changed since, ``new`` int64 [R]. Returns the sequence ids
        and their table rows (:meth:`table_rows`)."""
        return self._reserve(prefixes, rows, new)

    # ---- a decode step (graphcp.kv.decode) ------------------------------------------
    def reserve_decode(self, handles: "list[KVHandle]", rows: np.ndarray) -> DecodeSlots:
        """Reserve one more token of each live request (``rows``: what :meth:`prefix_rows`
        returned for ``handles``), all or nothing (KVCacheFull, nothing changed). Here every
        rank stores it, at its own position."""
        positions = self._request_tokens(rows)
        one = np.ones(len(handles), dtype=np.int64)
        ids, taken = self._reserve(handles, rows, one)
        slots = self.run_slots(taken, positions, one)
        return DecodeSlots(ids, taken, positions, np.full(len(ids), EVERY_RANK, dtype=np.int64), positions + 1,
                           slots)

    def rollback_decode(self, step: DecodeSlots) -> None:
        """Undo :meth:`reserve_decode` (the step's forward failed): each request one token shorter."""
        self.rollback(step.seq_ids, np.ones(step.num_requests, dtype=np.int64))

    def most_held(self, rows: np.ndarray) -> int:
        """The most tokens any rank's pool holds of one of the live requests in table
        ``rows`` (the same on every rank: a decode graph's page bucket). Here each rank
        holds every token."""
        return int(self._request_tokens(rows).max())

    def attention_holder(self, layer: int) -> int | None:
        """The one rank that attends over every request's KV of ``layer`` in a decode step
        (the rank whose cache keeps that layer), or None: each rank attends over what it
        holds (here every rank holds every layer whole)."""
        return None

    def _reserve(self, prefixes: list, rows: np.ndarray | None, new: np.ndarray) -> tuple[list[int], np.ndarray]:
        """Reserve ``new[i]`` more tokens in row ``rows[i]`` (``prefixes[i]``'s; -1, or
        ``rows`` None: a new sequence), all or nothing; KVCacheFull naming the request
        that does not fit. Returns the sequence ids and their rows. One compiled call
        (:func:`_reserve_pages`) counts and, when the batch fits, takes the rows and
        pages: the batch's new pages come off the free stack request 0's first, each
        request's in pop order."""
        num = new.shape[0]
        all_new = rows is None
        before = np.empty((2, num), dtype=np.int64)  # each request's tokens and pages before
        taken = np.empty(num, dtype=np.int64)  # each request's row, once taken
        while True:
            need, wide, fresh, done = _reserve_pages(
                _NO_ROWS if all_new else rows, all_new, new, self.page_size, self._row_tokens, self._row_pages,
                self._table, self._free, self._num_free, self._free_rows, self._num_free_rows, taken, before)
            if done or wide >= 0 or need > self._num_free:
                break
            self._grow_rows(2 * self._table.shape[0])  # too few free rows: double them, count again
        if wide >= 0:
            self._refuse_width(prefixes, rows, new, self._pages(before[0] + new))
        if not done:
            raise KVCacheFull(
                f"KV cache full: the batch needs {need} more pages of {self.page_size} tokens, "
                f"{self._num_free} are free (pool of {self.num_pages - 1} usable pages)", "kv_tokens"
            )
        first = self._next_id
        self._next_id = first + fresh
        self._num_free -= need
        self._num_free_rows -= fresh
        live = self._live_rows()  # (the previous reservation's deferred entries, written now)
        taken.setflags(write=False)  # the caller's copy and the undo's: read-only
        if all_new:
            created = None
            ids = list(range(first, first + num))
        else:
            created = (rows < 0).tolist()
            fresh_ids = iter(range(first, first + fresh))
            ids = [next(fresh_ids) if h is None else h.seq_id for h in prefixes]
            live.update(zip(range(first, first + fresh), compress(taken.tolist(), created)))
        self._last = _Reservation(ids[:], new if not new.flags.writeable else _frozen_copy(new), taken, need,
                                  before, created)
        if created is None:  # every request new: their id -> row entries wait for the first read
            self._pending = (self._last.ids, taken)
        return ids, taken

    def _refuse_width(self, prefixes: list, rows: np.ndarray | None, new: np.ndarray,
                      total_pages: np.ndarray) -> None:
        """KVCacheFull naming the first request that needs more pages than a table row holds."""
        width = self._table.shape[1]
        i = int(np.argmax(total_pages > width))
        old = rows is not None and rows[i] >= 0
        what = f"sequence {prefixes[i].seq_id}" if old else "a new sequence"
        have = int(self._row_tokens[rows[i]]) if old else 0
        raise KVCacheFull(
            f"KV cache full: request {i} ({what}, {have} + {int(new[i])} tokens) needs {int(total_pages[i])} "
            f"pages of {self.page_size} tokens, the page table holds at most {width} per sequence"
        )

    def rollback(self, seq_ids: list[int], new_tokens) -> None:
        """Undo an :meth:`extend` (a forward that failed after reserving): give back each
        sequence's last ``new_tokens[i]`` tokens and drop the sequences it created. The
        pages go back in reverse pop order and the rows likewise, so the free lists
        (their order included) are exactly what they were before the extend."""
        last = self._last
        new = new_tokens if last is not None and new_tokens is last.new else np.asarray(new_tokens, dtype=np.int64)
        if last is not None and last.undoes(seq_ids) and (new is last.new or np.array_equal(new, last.new)):
            self._undo_last()
            return
        rows = self.table_rows(seq_ids)
        tokens = self._row_tokens[rows]
        tokens -= new
        self._undo(seq_ids, rows, tokens, tokens == 0)

    def _undo_last(self) -> None:
        """Undo the last :meth:`extend` when nothing changed since (what a failed forward
        undoes): its pages still lie above the free stack's top, in order, so the undo
        clears what it wrote and puts back each row's counts."""
        last, self._last = self._last, None
        rows = last.rows
        _clear_pages(self._table, self._row_tokens, self._row_pages, rows, last.before)
        self._num_free += last.need
        self._drop(last.ids, rows, last.created)

    def _undo(self, seq_ids, rows: np.ndarray, tokens: np.ndarray, drop: np.ndarray) -> None:
        """Shrink row ``rows[i]`` to ``tokens[i]`` tokens (its pages past them back on the
        free stack, the batch's last page first) and drop the sequences marked in ``drop``
        (created by the undone extend)."""
        self._last = None
        self._num_free = _shrink_rows(self._table, self._row_tokens, self._row_pages, self._free, self._num_free,
                                      rows, tokens, self.page_size)
        self._drop(seq_ids, rows, drop.tolist())

    def _drop(self, seq_ids, rows: np.ndarray, drop: list[bool] | None) -> None:
        """Forget the sequences marked in ``drop`` (None: all) and push their rows, last
        first (the row stack as it was before the extend that took them)."""
        if drop is None or all(drop):
            gone, gone_rows = seq_ids, rows[::-1]
        elif any(drop):
            gone, gone_rows = list(compress(seq_ids, drop)), list(compress(rows.tolist(), drop))[::-1]
        else:
            return
        pending = self._pending
        if pending is not None and pending[0] is gone:  # the entries were never written: nothing to forget
            self._pending = None
        else:
            deque(map(self._live_rows().__delitem__, gone), maxlen=0)  # (a C-level loop)
        height = self._num_free_rows
        self._num_free_rows = height + len(gone_rows)
        self._free_rows[height : self._num_free_rows] = gone_rows

    def handle(self, seq_id: int) -> KVHandle:
        row = self._live_rows()[seq_id]
        return KVHandle(seq_id, int(self._row_tokens[row]), self._pages_of_row(row), self.cache_id)

    def release(self, handle: KVHandle) -> None:
        if not isinstance(handle, KVHandle) or handle.cache_id != self.cache_id:
            self.check_handle(handle)  # raises, naming what is wrong
        row = self._live_rows().pop(handle.seq_id, None)
        if row is None:
            raise KVHandleError(f"KV handle seq_id={handle.seq_id} is not live (already released?)")
        self._last = None
        n, top = int(self._row_pages[row]), self._num_free
        self._free[top : top + n] = self._table[row, :n][::-1]
        self._num_free = top + n
        self._table[row, :n] = SCRATCH_PAGE
        self._row_pages[row] = self._row_tokens[row] = 0
        self._free_rows[self._num_free_rows] = row
        self._num_free_rows += 1

    def stored_tokens(self) -> int:
        """Tokens whose KV this pool holds for live sequences."""
        return int(self._row_tokens.sum())  # free rows hold 0

    def stored_pages(self) -> int:
        """Pages this pool has handed out (scratch excluded)."""
        return self.num_pages - 1 - self._num_free

    def snapshot(self) -> tuple:
        """Allocator state, for tests that assert a failed call changed nothing: the free
        stack (bottom first) and each live sequence's (id, tokens, pages)."""
        free = tuple(self._free[: self._num_free].tolist())
        rt = self._row_tokens
        return free, tuple((k, int(rt[r]), self._pages_of_row(r)) for k, r in sorted(self._live_rows().items()))

    # ---- metadata -------------------------------------------------------------
    def table_rows(self, seq_ids: list[int]) -> np.ndarray:
        """[len(seq_ids)] int64: each live sequence's row of :attr:`table`."""
        return np.fromiter(map(self._live_rows().__getitem__, seq_ids), np.int64, len(seq_ids))

    def page_table(self, seq_ids: list[int], width: int | None = None) -> np.ndarray:
        """[len(seq_ids), width] int32 page ids, padded with the scratch page (a fresh
        array). ``width`` defaults to the most pages any of these sequences holds (>= 1)."""
        rows = self.table_rows(seq_ids)
        n_pages = self._row_pages.take(rows).tolist()  # max() of a short list beats a numpy reduction
        most = max(n_pages, default=0)
        if width is None:
            width = max(most, 1)
        elif most > width:
            i = next(i for i, n in enumerate(n_pages) if n > width)
            raise ValueError(f"sequence {seq_ids[i]} has {n_pages[i]} pages, page table width is {width}")
        return self.page_table_rows(rows, width)

    def page_table_rows(self, rows: np.ndarray, width: int, out: np.ndarray | None = None) -> np.ndarray:
        """:meth:`page_table` from :meth:`table_rows`, unchecked (the hot path): a
        [len(rows), width] int32 array (``out`` when given); columns past
        :attr:`table_width` are scratch."""
        w = self._table.shape[1]
        if width <= w:
            # take: faster than table[rows, :width]; into out, no second copy
            return self._table[:, :width].take(rows, axis=0, out=out)
        if out is None:
            out = np.empty((len(rows), width), dtype=np.int32)
        out[:, w:] = SCRATCH_PAGE
        self._table.take(rows, axis=0, out=out[:, :w])
        return out

    def slots(
        self, seq_rows: np.ndarray, positions: np.ndarray, run_request: np.ndarray, run_length: np.ndarray
    ) -> np.ndarray:
        """int64 [n]: the cache slot of each token, ``page * page_size + position % page_size``.

        The tokens come in runs (a rank's segments, say): run ``s`` is ``run_length[s]``
        consecutive tokens of request ``run_request[s]``, and ``seq_rows[j]`` is request
        ``j``'s row of the dense table (:meth:`table_rows`). The pages must be reserved
        (:meth:`extend`). Per token: one add, one table lookup and a few bit operations.
        """
        return self.run_slots(seq_rows[run_request], positions, run_length)

    def run_slots(self, run_rows: np.ndarray, positions: np.ndarray, run_length: np.ndarray) -> np.ndarray:
        """:meth:`slots` with each run's table row given (``run_rows[s]``: the row of run
        ``s``'s request), for a caller that gathered them already (the page table's)."""
        ps, table = self.page_size, self._table
        # virtual position: a request's positions offset by its table row, so that
        # vpos // page_size indexes the flattened table and vpos % page_size is the offset
        base = run_rows * (table.shape[1] * ps)
        vpos = base.repeat(run_length)
        vpos += positions
        flat = table.reshape(-1)
        shift = self._page_shift
        if shift is not None:  # a power-of-two page: shifts and masks, not divisions
            out = np.left_shift(flat.take(vpos >> shift), shift, dtype=np.int64)
            vpos &= ps - 1
            out |= vpos
        else:
            out = np.multiply(flat.take(vpos // ps), ps, dtype=np.int64)
            vpos %= ps
            out += vpos
        return out


_NO_ROWS = np.zeros(0, dtype=np.int64)  # the rows argument of an all-new batch (not read)


@host_kernel
def _reserve_pages(prefix_rows, all_new, new, page_size, row_tokens, row_pages, table, free, num_free, free_rows,
                   num_free_rows, taken, before):
    """:meth:`PagedKVCache._reserve`'s work: request ``i`` extends table row
    ``prefix_rows[i]`` by ``new[i]`` tokens, or is a new sequence (``all_new``, or the
    row < 0). Counts first: each request's tokens and pages before into ``before``
    [2, R]; returns ``(pages needed, first request wider than a table row or -1, new
    sequences, done)``. Only when every request fits a row and the free stacks
    (``free[:num_free]`` pages, ``free_rows[:num_free_rows]`` rows, tops last) hold
    enough, it takes them (``done``): each new sequence pops a row, each request pops
    its new pages into its row after the ones it has, each row's counts become the
    after counts, ``taken[i]`` request ``i``'s row; the caller lowers the stacks'
    heights by what was returned."""
    width = table.shape[1]
    need = fresh = 0
    wide = -1
    for i in range(new.shape[0]):
        tokens = pages = 0
        if all_new or prefix_rows[i] < 0:
            fresh += 1
        else:
            tokens, pages = row_tokens[prefix_rows[i]], row_pages[prefix_rows[i]]
        before[0, i], before[1, i] = tokens, pages
        after = (tokens + new[i] + page_size - 1) // page_size
        need += after - pages
        if wide < 0 and after > width:
            wide = i
    if wide >= 0 or need > num_free or fresh > num_free_rows:
        return need, wide, fresh, False
    top, height = num_free, num_free_rows
    for i in range(new.shape[0]):
        if all_new or prefix_rows[i] < 0:
            height -= 1
            row = free_rows[height]
        else:
            row = prefix_rows[i]
        taken[i] = row
        tokens = before[0, i] + new[i]
        after = (tokens + page_size - 1) // page_size
        for p in range(before[1, i], after):
            top -= 1
            table[row, p] = free[top]
        row_tokens[row] = tokens
        row_pages[row] = after
    return need, wide, fresh, True


@host_kernel
def _clear_pages(table, row_tokens, row_pages, rows, before):
    """Undo :func:`_reserve_pages` (nothing changed since): each row's pages past its
    count before (``before`` [2, R]: tokens, pages) become scratch again and its counts
    what they were; the pages are still above the free stack's top, in order (the
    caller raises its height)."""
    for i in range(rows.shape[0]):
        row = rows[i]
        for p in range(before[1, i], row_pages[row]):
            table[row, p] = SCRATCH_PAGE
        row_tokens[row] = before[0, i]
        row_pages[row] = before[1, i]


@host_kernel
def _shrink_rows(table, row_tokens, row_pages, free, num_free, rows, tokens, page_size):
    """Shrink row ``rows[i]`` to ``tokens[i]`` tokens: its pages past them go back on
    the free stack (``free[:num_free]``) in reverse pop order (the batch's last
    request's last page first), their cells become scratch. Returns the new height."""
    top = num_free
    for i in range(rows.shape[0] - 1, -1, -1):
        row = rows[i]
        keep = (tokens[i] + page_size - 1) // page_size
        for p in range(row_pages[row] - 1, keep - 1, -1):
            free[top] = table[row, p]
            top += 1
            table[row, p] = SCRATCH_PAGE
        row_tokens[row] = tokens[i]
        row_pages[row] = keep
    return top
