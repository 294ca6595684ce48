"""The token-sharded KV cache: each CP rank stores only its own zigzag blocks.

For every forward (every chunk of a chunked prefill) rank ``r`` stores the KV of
its early block ``r`` and late block ``2C-1-r`` of each request's new tokens, and
nothing else, so a request's cached prefix is spread over the ranks and a rank's
pool holds about ``1/C`` of every request. Within a rank a request's positions are
stored in increasing order (local index 0, 1, ...: its blocks of the first chunk,
then of the next, ...), in that rank's own pages.

Every rank keeps the same *ledger*: for each live request, the chunks that wrote it
and how many positions each rank holds (the zigzag rule decides, from the lengths
alone). From it each rank knows every other rank's holdings and page use without
asking: admission checks every rank's pool and refuses a batch the same way on all
of them (``KVCacheFull`` naming the rank, its free pages and what the batch needs),
and the ring attention knows what each rank sends. ``RuntimeConfig.kv_tokens`` is
one rank's pool.
"""

from __future__ import annotations

from collections import deque
from itertools import compress, repeat
from operator import add, itemgetter, not_

import numpy as np

from graphcp.cp.zigzag import rank_token_counts
from graphcp.jit import host_kernel
from graphcp.kv.decode import DecodeSlots, add_decoded, decode_owner, drop_decoded
from graphcp.kv.paged import KVCacheFull, KVHandle, PagedKVCache
from graphcp.kv.spans import KVSpan, position_spans
from graphcp.kv.spec import KVHeads, PoolSpec


class ShardedKVCache(PagedKVCache):
    """Rank ``rank``'s pool of a token-sharded cache over ``cp_size`` ranks (see the
    module doc). The allocator of :class:`PagedKVCache` manages this rank's pages
    (its sequences count the positions stored here); ``extend``, ``rollback``,
    ``release`` and the handles speak in whole requests, as for a replicated cache."""

    mode = "sharded"
    exchange = "ring"

    @classmethod
    def create(cls, geometry: KVHeads, pool: PoolSpec) -> "ShardedKVCache":
        return cls(len(pool.layers), pool.num_pages, pool.page_size, geometry.num_kv_heads, geometry.head_dim,
                   pool.dtype, pool.device, geometry.layout, max_pages_per_seq=pool.max_pages_per_seq,
                   first_layer=pool.layers.start, cp_size=pool.cp_size, rank=pool.rank)

    @classmethod
    def capture_bytes_for(cls, pool_bytes: int, num_layers: int, exchange: str) -> int:
        """pass-KV's two staging buffers, reserved at capture: two layers of the pool."""
        return 0 if exchange == "pass-q" else 2 * pool_bytes // max(num_layers, 1)

    def rows_bound(self, cp_size: int) -> int:
        """A rank's pool holds only its own tokens: a forward can give it a pool's worth."""
        return self.num_pages * self.page_size

    def stored_tokens_of(self, layer: int, batch_tokens: int, local_rows: int) -> int:
        """A rank keeps its own rows' K/V."""
        return local_rows

    def __init__(self, *args, cp_size: int, rank: int, **kw) -> None:
        super().__init__(*args, **kw)
        if not 0 <= rank < cp_size:
            raise ValueError(f"rank must be in [0, {cp_size}), got {rank}")
        self.cp_size, self.rank = cp_size, rank
        # the ledger: per table row, the positions each rank holds of its request, and per
        # live request the (cached, new) tokens of every forward that wrote it, in order
        self._held = np.zeros((self._table.shape[0], cp_size), dtype=np.int64)
        self._held_view = np.zeros((0, cp_size), dtype=np.int64)  # the read-only view :attr:`ledger` hands out
        self._chunks: dict[int, tuple[tuple[int, int], ...]] = {}
        #: pages each rank's pool has handed out (scratch excluded), from the ledger
        self._used = np.zeros(cp_size, dtype=np.int64)
        #: per live request that decoded: its decoded positions as runs (graphcp.kv.decode)
        self._decoded: dict[int, tuple[tuple[int, int], ...]] = {}
        # (the reservation, held before, pages it took, chunks before, decoded runs before: a decode step's)
        self._ledger_undo: tuple | None = None
        self._pending_chunks: tuple | None = None  # (ids, new tokens) of an all-new reservation, not yet in _chunks

    def _ledger_chunks(self) -> dict[int, tuple[tuple[int, int], ...]]:
        """Live sequence id -> its chunks. Like the base's id -> row map, an all-new
        reservation's entries are written on the first read after it (:meth:`_live_rows`)."""
        pending = self._pending_chunks
        if pending is not None:
            self._pending_chunks = None
            ids, new = pending
            self._chunks.update(zip(ids, zip(zip(repeat(0), new.tolist()))))
        return self._chunks

    def _grow_rows(self, rows: int) -> None:
        super()._grow_rows(rows)
        more = np.zeros((rows - self._held.shape[0], self.cp_size), dtype=np.int64)
        self._held = np.concatenate([self._held, more])

    # ---- capacity ---------------------------------------------------------------
    @property
    def rank_capacity_tokens(self) -> int:
        """Tokens one rank's pool holds (what ``kv_tokens`` sized)."""
        return super().capacity_tokens

    @property
    def capacity_tokens(self) -> int:
        """Tokens the C pools hold together: a request longer than this fits no
        sharding (``extend`` checks each rank's pool exactly)."""
        return self.cp_size * super().capacity_tokens

    @property
    def num_free_pages(self) -> int:
        """The fewest free pages of any rank: what a batch planned the same way on every
        rank can count on (this rank's own: :attr:`rank_free_pages`)."""
        return int(self.num_pages - 1 - self._used.max())

    def rank_free_pages(self) -> np.ndarray:
        """int64 [C]: free pages of every rank's pool."""
        return self.num_pages - 1 - self._used

    def _request_tokens(self, rows: np.ndarray) -> np.ndarray:
        return self._held[rows].sum(axis=1)

    # ---- allocation -------------------------------------------------------------
    def reserve(self, prefixes: "list[KVHandle | None]", rows: np.ndarray | None,
                new: np.ndarray) -> tuple[list[int], np.ndarray]:
        """Reserve, on every rank, each request's share of ``new[i]`` more tokens after
        ``prefixes[i]``; all or nothing, and the same outcome on every rank (``extend``
        through here; the arguments as :meth:`PagedKVCache.reserve` takes them). The
        counts and the room check are one compiled pass (:func:`_ledger_room`)."""
        num, C = new.shape[0], self.cp_size
        held = np.empty((num, C), dtype=np.int64)  # each request's tokens on each rank before (0: new)
        after = np.empty((num, C), dtype=np.int64)  # and after, as the ledger's rows hold them
        mine = np.empty(num, dtype=np.int64)  # this rank's new tokens of each request
        cached = np.empty(num, dtype=np.int64)  # each request's tokens before, all ranks
        need = np.empty(C, dtype=np.int64)  # the pages the batch takes on every rank
        all_new = rows is None  # every request new: nothing held, no chunk before
        if _ledger_room(self._held, _NO_ROWS if all_new else rows, all_new, new, self.page_size, self.page_shift,
                        self.table_width, self._used, self.num_pages - 1, self.rank, held, after, mine, cached, need):
            self._check_room(None if all_new else held, after)  # raises, worded as the room check words it
            raise RuntimeError("the compiled room check refused a batch the reference admits (a bug)")
        ids, rows = self._reserve(prefixes, rows, mine)
        _set_rows(self._held, rows, after)
        # each request's chunks gain (cached, new): zip(zip(a, b)) yields ((a_i, b_i),)
        chunks = self._ledger_chunks()  # (the previous reservation's deferred chunks, written now)
        if all_new:  # every request new: its one chunk (0, new) waits for the first read
            held = before = None
            self._pending_chunks = (self._last.ids, new.copy() if new.flags.writeable else new)
        else:
            before = list(map(chunks.get, ids, repeat(())))
            chunks.update(zip(ids, map(add, before, zip(zip(cached.tolist(), new.tolist())))))
        self._used += need
        # what the undo of this reservation writes back (valid while it is the last one)
        self._ledger_undo = (self._last, held, need, before, None)
        return ids, rows

    def reserve_decode(self, handles: "list[KVHandle]", rows: np.ndarray) -> DecodeSlots:
        """One more token of each request on one rank (the one holding fewest of it,
        round-robin among equals: graphcp.kv.decode), on every rank's ledger alike; all or nothing (KVCacheFull naming
        the rank that is short, on every rank)."""
        B = len(handles)
        held = self._held[rows]  # [B, C] before (a copy)
        positions = held.sum(axis=1)
        holder = decode_owner(held, positions)
        after = held.copy()
        after[np.arange(B), holder] += 1
        need = self._check_room(held, after)
        mine = (holder == self.rank).astype(np.int64)
        local = held[:, self.rank]
        ids, taken = self._reserve(handles, rows, mine)
        _set_rows(self._held, taken, after)
        chunks = self._ledger_chunks()
        decoded = self._decoded
        before = list(map(decoded.get, ids, repeat(())))
        decoded.update(zip(ids, map(add_decoded, before, positions.tolist(), map(tuple, held.tolist()))))
        self._used += need
        self._ledger_undo = (self._last, held, need, list(map(chunks.__getitem__, ids)), before)
        slots = np.full(B, -1, dtype=np.int64)  # -1: another rank stores it (the write lands in scratch)
        here = mine > 0
        if here.any():
            slots[here] = self.run_slots(taken[here], local[here], mine[here])
        return DecodeSlots(ids, taken, positions, holder, local + mine, slots)

    def most_held(self, rows: np.ndarray) -> int:
        """The most tokens any rank holds of one of these requests (every rank's ledger says)."""
        return int(self._held[rows].max())

    def rollback_decode(self, step: DecodeSlots) -> None:
        """Undo :meth:`reserve_decode`: every rank's ledger and this rank's pages as they were."""
        last, undo = self._last, self._ledger_undo
        if last is not None and undo is not None and undo[0] is last and last.undoes(step.seq_ids):
            self._undo_last_ledger(step.seq_ids, last, undo)
            return
        rows = self.table_rows(step.seq_ids)  # something changed since: undo request by request
        after = self._held[rows]
        before = after.copy()
        before[np.arange(len(rows)), step.holder] -= 1
        self._used -= np.add.reduce(self._pages(after) - self._pages(before), axis=0)
        _set_rows(self._held, rows, before)
        for s in step.seq_ids:
            self._decoded[s] = drop_decoded(self._decoded[s])
            if not self._decoded[s]:
                del self._decoded[s]
        mine = (step.holder == self.rank).astype(np.int64)
        self._undo(step.seq_ids, rows, self._row_tokens[rows] - mine, np.zeros(len(rows), dtype=bool))

    def _check_room(self, held: np.ndarray | None, after: np.ndarray) -> np.ndarray:
        """int64 [C]: the pages the batch takes on every rank (``held``: each request's
        tokens on each rank before, [R, C], None: none; ``after``: after); KVCacheFull
        (on every rank alike) unless every rank's pool takes its share. The reference of
        :func:`_ledger_room`, and what words its refusals."""
        after = self._pages(after)  # [R, C]
        width = self.table_width
        if after.size and int(np.maximum.reduce(after, axis=None)) > width:
            j, k = (int(x[0]) for x in np.nonzero(after > width))
            raise KVCacheFull(
                f"KV cache full: request {j} needs {int(after[j, k])} pages of {self.page_size} tokens on rank {k}, "
                f"the page table holds at most {width} per sequence"
            )
        need = np.add.reduce(after, axis=0)
        if held is not None:
            need -= np.add.reduce(self._pages(held), axis=0)
        free = self.rank_free_pages()
        short = np.flatnonzero(need > free)
        if short.size:
            k = int(short[np.argmax((need - free)[short])])
            raise KVCacheFull(
                f"KV cache full on rank {k}: the batch needs {int(need[k])} more pages of {self.page_size} tokens "
                f"there, {int(free[k])} are free (one rank's pool: {self.num_pages - 1} usable pages, "
                f"{self.rank_capacity_tokens} tokens; the sharded cache spreads each request over {self.cp_size} "
                "pools)", "kv_tokens")
        return need

    def rollback(self, seq_ids: list[int], new_tokens=None) -> None:
        """Undo an :meth:`extend`: each request's last chunk (the ledger's, so
        ``new_tokens`` is not needed) comes off every rank's share at once."""
        last, undo = self._last, self._ledger_undo
        if last is not None and undo is not None and undo[0] is last and last.undoes(seq_ids):
            self._undo_last_ledger(seq_ids, last, undo)
            return
        rows = self.table_rows(seq_ids)
        chunks = list(map(self._ledger_chunks().__getitem__, seq_ids))
        new = np.fromiter(map(itemgetter(1), map(itemgetter(-1), chunks)), np.int64, len(chunks))
        counts = rank_token_counts(self.cp_size, new)  # [C, R]
        after = self._held[rows].T
        before = after - counts
        self._used -= self._pages(after).sum(axis=1) - self._pages(before).sum(axis=1)
        self._held[rows] = before.T
        rest = list(map(itemgetter(slice(None, -1)), chunks))
        self._chunks.update(zip(seq_ids, rest))
        dropped = np.fromiter(map(not_, rest), bool, len(rest))  # no chunk left: the extend created it
        for i in np.flatnonzero(dropped).tolist():
            del self._chunks[seq_ids[i]]
        last = self._last
        if last is not None and last.undoes(seq_ids):  # the last extend, nothing changed since
            self._undo_last()
        else:
            self._undo(seq_ids, rows, self._row_tokens[rows] - counts[self.rank], dropped)

    def _undo_last_ledger(self, seq_ids: list[int], last, undo: tuple) -> None:
        """Undo the last :meth:`reserve` when nothing changed since (what a failed forward
        undoes): the ledger's rows, page counts and chunks as that reservation found them,
        then this rank's pages and rows (:meth:`PagedKVCache._undo_last`)."""
        _, held, need, before, decoded = undo
        self._ledger_undo = None
        if decoded is not None:  # a decode step: each request's decoded runs as they were
            self._decoded.update(zip(seq_ids, decoded))
            deque(map(self._decoded.pop, compress(seq_ids, map(not_, decoded))), maxlen=0)
        _set_rows(self._held, last.rows, _NO_COUNTS if held is None else held)
        self._used -= need
        if before is None:  # every request was new: its ledger entry goes (or was never written)
            pending = self._pending_chunks
            if pending is not None and pending[0] is last.ids:
                self._pending_chunks = None
            else:
                deque(map(self._ledger_chunks().__delitem__, seq_ids), maxlen=0)
        else:
            chunks = self._ledger_chunks()
            chunks.update(zip(seq_ids, before))
            deque(map(chunks.__delitem__, compress(seq_ids, last.created)), maxlen=0)
        self._undo_last()

    def release(self, handle: KVHandle) -> None:
        row = self._live_rows().get(handle.seq_id) if isinstance(handle, KVHandle) else None
        super().release(handle)  # checks the handle, frees this rank's pages
        self._used -= self._pages(self._held[row])
        self._held[row] = 0
        del self._ledger_chunks()[handle.seq_id]
        self._decoded.pop(handle.seq_id, None)

    def handle(self, seq_id: int) -> KVHandle:
        row = self._live_rows()[seq_id]
        held = self._held[row].tolist()
        return KVHandle(seq_id, sum(held), self._pages_of_row(row), self.cache_id, "sharded",
                        self.cp_size, self._ledger_chunks()[seq_id], tuple(held), self._decoded.get(seq_id, ()))

    def snapshot(self) -> tuple:
        chunks = self._ledger_chunks()
        decoded = self._decoded  # (a request that decoded: its runs too)
        ledger = tuple((k, chunks[k], tuple(self._held[r].tolist())) + ((decoded[k],) if k in decoded else ())
                       for k, r in sorted(self._live_rows().items()))
        return super().snapshot() + (ledger, tuple(self._used.tolist()))

    # ---- what the ring reads ----------------------------------------------------
    def rank_tokens(self, seq_ids: list[int], rows: np.ndarray | None = None) -> np.ndarray:
        """int64 [C, len(seq_ids)]: positions each rank holds of these live sequences
        (``rows``: their :meth:`table_rows`, when the caller has them)."""
        return np.ascontiguousarray(self._held[self.table_rows(seq_ids) if rows is None else rows].T)

    @property
    def page_shift(self) -> int:
        """log2 of the page size when it is a power of two, else -1 (:func:`page_count`)."""
        return -1 if self._page_shift is None else self._page_shift

    @property
    def ledger(self) -> np.ndarray:
        """The ledger's counts as a read-only int64 [rows, C] view: row ``seq_rows[j]``
        (:meth:`table_rows`) holds the positions each rank holds of request ``j`` (what
        the ring's plan reads; reallocated when the table grows, so do not hold it
        across :meth:`extend`)."""
        view = self._held_view
        if view.base is not self._held:  # first use, or the ledger grew: a new view of it
            view = self._held_view = self._held.view()
            view.flags.writeable = False
        return view

    def rank_used_pages(self) -> np.ndarray:
        """int64 [C]: pages every rank's pool has handed out (the ledger's count)."""
        return self._used.copy()


    # ---- export (graphcp.kv.spans.KVSource) --------------------------------------
    def kv_spans(self, handle: KVHandle, cp_size: int) -> list[KVSpan]:
        """Per layer, one span per run of consecutive positions a rank stores (its zigzag
        blocks of every forward that wrote the request, adjacent blocks merged), owned by
        that rank, in position order: each rank exports what it holds, nothing else."""
        return position_spans(self.num_layers, [handle.positions(r) for r in range(cp_size)], self.first_layer)

    def holds(self, span: KVSpan, rank: int) -> bool:
        return rank == span.owner

    def local_index(self, handle: KVHandle, position: int) -> int:
        """This rank's local index of ``position``: its rank in the (increasing) positions
        this rank stores; ValueError when another rank holds it."""
        held = handle.positions(self.rank)
        i = int(np.searchsorted(held, position))
        if i == len(held) or held[i] != position:
            raise ValueError(f"rank {self.rank} does not hold position {position} of sequence {handle.seq_id} "
                             "(the token-sharded cache keeps each position on one rank)")
        return i


_NO_ROWS = np.zeros(0, dtype=np.int64)  # the rows argument of an all-new batch (not read)
_NO_COUNTS = np.zeros((0, 0), dtype=np.int64)  # the values argument of _set_rows that clears the rows


@host_kernel
def page_count(tokens, page_size, page_shift):
    """Pages ``tokens`` (>= 0) positions fill: a shift when the page is a power of two
    (``page_shift`` its log2; -1 otherwise). Integer division costs ~10x a shift, and the
    kernels below count pages per request and rank."""
    if page_shift >= 0:
        return (tokens + page_size - 1) >> page_shift
    return (tokens + page_size - 1) // page_size


@host_kernel
def _ledger_room(ledger, prefix_rows, all_new, new, page_size, page_shift, width, used, usable, rank, held, after,
                 mine, cached, need):
    """:meth:`ShardedKVCache.reserve`'s counts and room check in one pass. Request ``i``
    extends ledger row ``prefix_rows[i]`` (``ledger`` [rows, C]: positions each rank
    holds) by ``new[i]`` tokens, or is a new sequence (``all_new``, or the row < 0).
    Writes its tokens on every rank before (0 when new) into ``held`` [R, C] and after
    its zigzag blocks (of L tokens, ``L // 2C`` each and one more for the first
    ``L % 2C``; rank r's are r and 2C-1-r) into ``after`` [R, C], this rank's new tokens
    into ``mine`` [R], its tokens before over all ranks into ``cached`` [R], and the
    pages each rank's pool takes into ``need`` [C] (:func:`page_count`). Returns 0
    when every request's share fits a table row of ``width`` pages on every rank and
    every rank's free pages (``usable`` less ``used[k]``) hold its need; 1 (too wide)
    or 2 (a rank short) otherwise."""
    C = need.shape[0]
    c2 = 2 * C
    for k in range(C):
        need[k] = 0
    wide = False
    for i in range(new.shape[0]):
        row = -1 if all_new else prefix_rows[i]
        base = new[i] // c2  # (one division a request: per block it would cost ~10x the rest)
        extra = new[i] - base * c2
        total = 0
        for k in range(C):  # (no branch but the ledger's: the loop compiles to vector code)
            have = 0 if row < 0 else ledger[row, k]
            total += have
            got = 2 * base + (k < extra) + (c2 - 1 - k < extra)
            held[i, k] = have
            after[i, k] = have + got
            pages = page_count(have + got, page_size, page_shift)
            wide |= pages > width
            need[k] += pages - page_count(have, page_size, page_shift)
        mine[i] = after[i, rank] - held[i, rank]
        cached[i] = total
    if wide:
        return 1
    for k in range(C):
        if need[k] > usable - used[k]:
            return 2
    return 0


@host_kernel
def _set_rows(ledger, rows, values):
    """``ledger[rows[i]] = values[i]`` for every i, or 0 when ``values`` has no rows (a
    numpy scatter of a batch's rows costs several microseconds)."""
    for i in range(rows.shape[0]):
        for k in range(ledger.shape[1]):
            ledger[rows[i], k] = values[i, k] if values.shape[0] else 0
