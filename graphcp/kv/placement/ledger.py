"""The token-sharded cache's ledger: what every rank holds of every live request, kept
the same on every rank (graphcp.kv.placement.sharded).

Per table row (the allocator's rows: the ledger grows with the table) the positions each
rank holds of its request; per live request the ``(cached, new)`` tokens of every
forward that wrote it (the zigzag rule decides each rank's share from the lengths
alone) and the runs of positions decode steps added (graphcp.kv.decode); per rank the
pages its pool has handed out. From it each rank knows every other rank's holdings and
page use without asking: admission checks every rank's pool and refuses a batch the
same way on all of them, and the ring attention knows what each rank sends.
"""

from __future__ import annotations

from collections import deque
from itertools import compress, repeat
from operator import not_

import numpy as np

from graphcp.jit import host_kernel
from graphcp.kv.allocator import PageAllocator, Reservation
from graphcp.kv.handle import KVCacheFull

#: the ledger's record of one request: its chunks, and its decoded runs (graphcp.kv.decode)
Chunks = tuple[tuple[int, int], ...]


class Ledger:
    """The ledger of ``cp_size`` ranks over this rank's ``allocator`` (module doc). Its
    undo record is valid while the allocator's last reservation is the one it made."""

    def __init__(self, allocator: PageAllocator, cp_size: int) -> None:
        self.allocator, self.cp_size = allocator, cp_size
        #: [rows, C] int64: the positions each rank holds of the request in each table row
        self.held = np.zeros((allocator.table.cells.shape[0], cp_size), dtype=np.int64)
        self._view = np.zeros((0, cp_size), dtype=np.int64)  # the read-only view :attr:`counts` hands out
        self._chunks: dict[int, Chunks] = {}
        #: (ids, new tokens) of an all-new reservation, not yet in the chunks (:meth:`chunks`)
        self.pending: tuple | None = None
        #: per live request that decoded: its decoded positions as runs (graphcp.kv.decode)
        self.decoded: dict[int, tuple] = {}
        #: [C] int64: pages each rank's pool has handed out (scratch excluded)
        self.used = np.zeros(cp_size, dtype=np.int64)
        #: (the reservation, held before, pages it took, chunks before, decoded runs before: a decode step's)
        self.undo_record: tuple | None = None

    def fit(self) -> None:
        """Grow the per-row counts with the allocator's table (a reservation may grow it)."""
        rows = self.allocator.table.cells.shape[0]
        if rows > self.held.shape[0]:
            self.held = np.concatenate([self.held, np.zeros((rows - self.held.shape[0], self.cp_size), np.int64)])

    def chunks(self) -> dict[int, Chunks]:
        """Live sequence id -> its chunks. Like the table's id -> row map, an all-new
        reservation's entries are written on the first read after it."""
        pending = self.pending
        if pending is not None:
            self.pending = None
            ids, new = pending
            self._chunks.update(zip(ids, zip(zip(repeat(0), new.tolist()))))
        return self._chunks

    @property
    def counts(self) -> np.ndarray:
        """The per-row counts as a read-only int64 [rows, C] view: row ``seq_rows[j]`` (the
        table's) holds the positions each rank holds of request ``j`` (what the ring's plan
        reads; reallocated when the table grows, so do not hold it across a reservation)."""
        view = self._view
        if view.base is not self.held:  # first use, or the ledger grew: a new view of it
            view = self._view = self.held.view()
            view.flags.writeable = False
        return view

    def free_pages(self) -> np.ndarray:
        """int64 [C]: free pages of every rank's pool."""
        return self.allocator.num_pages - 1 - self.used

    def room(self, rows: np.ndarray | None, new: np.ndarray, rank: int, held: np.ndarray, after: np.ndarray,
             mine: np.ndarray, cached: np.ndarray, need: np.ndarray) -> bool:
        """Whether a batch's shares fit every rank (:func:`_ledger_room`, writing the counts)."""
        a, t = self.allocator, self.allocator.table
        return not _ledger_room(self.held, _NO_ROWS if rows is None else rows, rows is None, new, a.page_size,
                                t.page_shift, t.width, self.used, a.num_pages - 1, rank, held, after, mine, cached,
                                need)

    def check_room(self, held: np.ndarray | None, after: np.ndarray) -> np.ndarray:
        """int64 [C]: the pages the batch takes on every rank (``held``: each request's
        tokens on each rank before, [R, C], None: none; ``after``: after); KVCacheFull
        (on every rank alike) unless every rank's pool takes its share. The reference of
        :func:`_ledger_room`, and what words its refusals."""
        a = self.allocator
        after = a.pages(after)  # [R, C]
        width = a.table.width
        if after.size and int(np.maximum.reduce(after, axis=None)) > width:
            j, k = (int(x[0]) for x in np.nonzero(after > width))
            raise KVCacheFull(
                f"KV cache full: request {j} needs {int(after[j, k])} pages of {a.page_size} tokens on rank {k}, "
                f"the page table holds at most {width} per sequence"
            )
        need = np.add.reduce(after, axis=0)
        if held is not None:
            need -= np.add.reduce(a.pages(held), axis=0)
        free = self.free_pages()
        short = np.flatnonzero(need > free)
        if short.size:
            k = int(short[np.argmax((need - free)[short])])
            raise KVCacheFull(
                f"KV cache full on rank {k}: the batch needs {int(need[k])} more pages of {a.page_size} tokens "
                f"there, {int(free[k])} are free (one rank's pool: {a.num_pages - 1} usable pages, "
                f"{a.capacity_tokens} tokens; the sharded cache spreads each request over {self.cp_size} "
                "pools)", "kv_tokens")
        return need

    def set_rows(self, rows: np.ndarray, values: np.ndarray | None) -> None:
        """``held[rows[i]] = values[i]`` (None: 0), after fitting the table."""
        self.fit()
        _set_rows(self.held, rows, _NO_COUNTS if values is None else values)

    def undo_last(self, seq_ids: list[int], last: Reservation) -> None:
        """Undo the ledger's side of the last reservation (:attr:`undo_record`): its rows,
        page counts and chunks (or decoded runs) as that reservation found them."""
        _, held, need, before, decoded = self.undo_record
        self.undo_record = None
        if decoded is not None:  # a decode step: each request's decoded runs as they were
            self.decoded.update(zip(seq_ids, decoded))
            deque(map(self.decoded.pop, compress(seq_ids, map(not_, decoded))), maxlen=0)
        self.set_rows(last.rows, held)
        self.used -= need
        if before is None:  # every request was new: its ledger entry goes (or was never written)
            pending = self.pending
            if pending is not None and pending[0] is last.ids:
                self.pending = None
            else:
                deque(map(self.chunks().__delitem__, seq_ids), maxlen=0)
        else:
            chunks = self.chunks()
            chunks.update(zip(seq_ids, before))
            deque(map(chunks.__delitem__, compress(seq_ids, last.created)), maxlen=0)

    def undoes(self, seq_ids: list[int]) -> Reservation | None:
        """The allocator's last reservation when it is this ledger's record and undoes
        ``seq_ids`` (nothing changed since), else None."""
        last, record = self.allocator.last, self.undo_record
        if last is not None and record is not None and record[0] is last and last.undoes(seq_ids):
            return last
        return None

    def release(self, row: int, seq_id: int) -> None:
        self.used -= self.allocator.pages(self.held[row])
        self.held[row] = 0
        del self.chunks()[seq_id]
        self.decoded.pop(seq_id, None)

    def snapshot(self, live: dict[int, int]) -> tuple:
        """Each live request's (id, chunks, tokens on each rank[, decoded runs]), and the used pages."""
        chunks = self.chunks()
        decoded = self.decoded  # (a request that decoded: its runs too)
        ledger = tuple((k, chunks[k], tuple(self.held[r].tolist())) + ((decoded[k],) if k in decoded else ())
                       for k, r in sorted(live.items()))
        return ledger, tuple(self.used.tolist())


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
    """:meth:`Ledger.room`'s counts and room check in one pass. Request ``i`` extends
    ledger row ``prefix_rows[i]`` (``ledger`` [rows, C]: positions each rank holds) by
    ``new[i]`` tokens, or is a new sequence (``all_new``, or the row < 0). Writes its
    tokens on every rank before (0 when new) into ``held`` [R, C] and after its zigzag
    blocks (of L tokens, ``L // 2C`` each and one more for the first ``L % 2C``; rank r's
    are r and 2C-1-r) into ``after`` [R, C], this rank's new tokens into ``mine`` [R], its
    tokens before over all ranks into ``cached`` [R], and the pages each rank's pool takes
    into ``need`` [C] (:func:`page_count`). Returns 0 when every request's share fits a
    table row of ``width`` pages on every rank and every rank's free pages (``usable``
    less ``used[k]``) hold its need; 1 (too wide) or 2 (a rank short) otherwise."""
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
