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
sequence owns a row holding its ``pages`` followed by the scratch page. Every
allocator call keeps it exactly in step with the page lists, so the per-forward
:meth:`PagedKVCache.page_table` is one numpy gather, not a Python loop per request.
Rows are recycled; when none is free the table doubles its rows.

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
from dataclasses import dataclass, field

import numpy as np
import torch

from graphcp.cp.zigzag import ZigzagLayout
from graphcp.errors import BatchError
from graphcp.kv.layout import KVLayout, kv_cache_views
from graphcp.kv.spans import KVSpan, whole_layer_spans

SCRATCH_PAGE = 0


class KVCacheFull(BatchError, RuntimeError):
    """Not enough free pages for a batch; the pool is unchanged. A BatchError (and,
    as before, a RuntimeError)."""


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
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


@dataclass
class _Sequence:
    num_tokens: int
    row: int  # its row of the dense page table
    pages: list[int] = field(default_factory=list)


_INITIAL_ROWS = 16


class PagedKVCache:
    #: the forward must fetch a cached prefix's pages of each layer before attention
    #: (a cache that does not keep every layer: graphcp.kv.layer_split)
    needs_prefix_fetch = False

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
        # LIFO free list: recently freed pages are reused first (warm in cache)
        self._free: list[int] = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self.cache_id = uuid.uuid4().hex  # stamped on every handle this cache issues
        # the dense page table; _row_pages[r] = len(pages) of row r's sequence (0 when free)
        self._table = np.full((_INITIAL_ROWS, max_pages_per_seq), SCRATCH_PAGE, dtype=np.int32)
        self._row_pages = np.zeros(_INITIAL_ROWS, dtype=np.int64)
        self._free_rows: list[int] = list(range(_INITIAL_ROWS - 1, -1, -1))  # LIFO, low rows first

    def _allocate_pool(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """The pool (a cache that stores something else per token, MLA's latent, overrides it)."""
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

    # ---- capacity -------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool can hold across all requests (scratch page excluded)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def layer(self, i: int) -> torch.Tensor:
        """The cache of global decoder layer ``i``."""
        return self.pool[self.local_layer(i)]

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
        view = self._table.view()
        view.flags.writeable = False
        return view

    def _take_row(self) -> int:
        if not self._free_rows:  # double the rows; the new ones are handed out low first
            n, w = self._table.shape
            table = np.full((2 * n, w), SCRATCH_PAGE, dtype=np.int32)
            table[:n] = self._table
            self._table = table
            self._row_pages = np.concatenate([self._row_pages, np.zeros(n, dtype=np.int64)])
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def _truncate(self, seq: _Sequence, keep: int) -> None:
        """Drop ``seq``'s pages past ``keep`` from its row (the page list is the caller's)."""
        self._table[seq.row, keep : len(seq.pages)] = SCRATCH_PAGE
        self._row_pages[seq.row] = keep

    # ---- allocation -----------------------------------------------------------
    def check_handle(self, handle: KVHandle) -> None:
        """KVHandleError unless ``handle`` is a live, current handle issued by this cache."""
        if not isinstance(handle, KVHandle):
            raise KVHandleError(f"a prefix must be a KVHandle returned by this engine (or None), "
                                f"got {type(handle).__name__} {handle!r}"[:200])
        if handle.cache_id != self.cache_id:
            raise KVHandleError(f"KV handle seq_id={handle.seq_id} was issued by another KV cache (another engine); "
                                "pass a handle only to the engine that returned it")
        seq = self._seqs.get(handle.seq_id)
        if seq is None:
            raise KVHandleError(f"KV handle seq_id={handle.seq_id} is not live (released, or its forward failed)")
        total = self._request_tokens(handle.seq_id)
        if total != handle.num_tokens:
            raise KVHandleError(
                f"KV handle seq_id={handle.seq_id} is stale: it holds {handle.num_tokens} tokens, "
                f"the cache now holds {total} (it was extended since)"
            )

    def _request_tokens(self, seq_id: int) -> int:
        """A live sequence's positions (what its handle's num_tokens says): here all of
        them are stored; a sharded cache stores a share."""
        return self._seqs[seq_id].num_tokens

    def extend(self, prefixes: "list[KVHandle | None]", new_tokens: list[int]) -> list[int]:
        """Reserve room for ``new_tokens[i]`` more tokens after ``prefixes[i]`` (a new
        sequence when None), all or nothing. Returns the sequence ids."""
        if len(prefixes) != len(new_tokens):
            raise ValueError("prefixes and new_tokens must have the same length")
        seen: set[int] = set()
        need = 0
        width = self._table.shape[1]
        for i, (h, n) in enumerate(zip(prefixes, new_tokens)):
            have = 0
            if h is not None:
                self.check_handle(h)
                if h.seq_id in seen:
                    raise KVHandleError(f"KV handle seq_id={h.seq_id} is the prefix of two requests in one batch")
                seen.add(h.seq_id)
                have = self._seqs[h.seq_id].num_tokens  # what this pool stores of it
            total = self.pages_for(have + n)
            if total > width:
                what = "a new sequence" if h is None else f"sequence {h.seq_id}"
                raise KVCacheFull(
                    f"KV cache full: request {i} ({what}, {have} + {n} tokens) needs {total} pages of "
                    f"{self.page_size} tokens, the page table holds at most {width} per sequence"
                )
            need += total - self.pages_for(have)
        if need > len(self._free):
            raise KVCacheFull(
                f"KV cache full: the batch needs {need} more pages of {self.page_size} tokens, "
                f"{len(self._free)} are free (pool of {self.num_pages - 1} usable pages)"
            )
        ids = []
        for h, n in zip(prefixes, new_tokens):
            if h is None:
                sid, seq = self._next_id, _Sequence(0, self._take_row())
                self._next_id += 1
                self._seqs[sid] = seq
            else:
                sid, seq = h.seq_id, self._seqs[h.seq_id]
            have = len(seq.pages)
            grow = self.pages_for(seq.num_tokens + n) - have
            if grow:
                taken = self._free[-grow:]  # slices, not a pop per page: batches take thousands
                del self._free[-grow:]
                taken.reverse()
                seq.pages.extend(taken)
                self._table[seq.row, have : have + grow] = taken
                self._row_pages[seq.row] = have + grow
            seq.num_tokens += n
            ids.append(sid)
        return ids

    def rollback(self, seq_ids: list[int], new_tokens: list[int]) -> None:
        """Undo an :meth:`extend` (a forward that failed after reserving). Sequences are
        undone last-first and pages pushed back in reverse pop order, so the free list
        (its order included) is exactly what it was before the extend."""
        for sid, n in reversed(list(zip(seq_ids, new_tokens))):
            self._shrink(sid, n, drop=self._seqs[sid].num_tokens == n)

    def _shrink(self, sid: int, n: int, drop: bool) -> None:
        """Give back sequence ``sid``'s last ``n`` tokens (their pages, in reverse pop
        order); ``drop``: the sequence was created by the undone extend, so it goes too."""
        seq = self._seqs[sid]
        seq.num_tokens -= n
        keep = self.pages_for(seq.num_tokens)
        if len(seq.pages) > keep:
            self._free.extend(reversed(seq.pages[keep:]))
            self._truncate(seq, keep)
            del seq.pages[keep:]
        if drop:
            del self._seqs[sid]
            self._free_rows.append(seq.row)  # undone last-first: the row free list is restored too

    def handle(self, seq_id: int) -> KVHandle:
        seq = self._seqs[seq_id]
        return KVHandle(seq_id, seq.num_tokens, tuple(seq.pages), self.cache_id)

    def release(self, handle: KVHandle) -> None:
        if not isinstance(handle, KVHandle) or handle.cache_id != self.cache_id:
            self.check_handle(handle)  # raises, naming what is wrong
        seq = self._seqs.pop(handle.seq_id, None)
        if seq is None:
            raise KVHandleError(f"KV handle seq_id={handle.seq_id} is not live (already released?)")
        self._free.extend(reversed(seq.pages))
        self._truncate(seq, 0)
        self._free_rows.append(seq.row)

    def stored_tokens(self) -> int:
        """Tokens whose KV this pool holds for live sequences."""
        return sum(seq.num_tokens for seq in self._seqs.values())

    def stored_pages(self) -> int:
        """Pages this pool has handed out (scratch excluded)."""
        return self.num_pages - 1 - len(self._free)

    def snapshot(self) -> tuple:
        """Allocator state, for tests that assert a failed call changed nothing."""
        return (tuple(self._free), tuple((k, v.num_tokens, tuple(v.pages)) for k, v in sorted(self._seqs.items())))

    # ---- metadata -------------------------------------------------------------
    def table_rows(self, seq_ids: list[int]) -> np.ndarray:
        """[len(seq_ids)] int64: each live sequence's row of :attr:`table`."""
        seqs = self._seqs
        return np.array([seqs[s].row for s in seq_ids], dtype=np.int64)

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
        ps, table = self.page_size, self._table
        # virtual position: a request's positions offset by its table row, so that
        # vpos // page_size indexes the flattened table and vpos % page_size is the offset
        base = seq_rows[run_request]
        base *= table.shape[1] * ps
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
