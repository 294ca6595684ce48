"""The allocator of a paged cache: this rank's pages, its free stack, the dense page
table (graphcp.kv.page_table) and the batch's reservation and rollback. It knows pages
and rows only: what a page holds is the storage's, which rank holds which tokens the
placement's (graphcp.kv.placement), and a placement reserves here the tokens that land
on this rank.

A batch is reserved and undone whole: :meth:`PageAllocator.reserve` takes all the
batch's new pages off the free stack in one compiled call and writes them into the
table rows; :meth:`PageAllocator.rollback` gives them back the same way. The free pages
are a stack (a numpy array and its height), so the order of the free list after a
rollback is exactly what it was before the reservation.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter

import numpy as np

from graphcp.jit import host_kernel
from graphcp.kv.handle import KVCacheFull
from graphcp.kv.page_table import SCRATCH_PAGE, PageTable


@dataclass(slots=True)
class Reservation:
    """What one :meth:`PageAllocator.reserve` changed, to undo it without recomputing."""

    ids: list[int]  # the sequence ids it returned (a copy)
    new: np.ndarray  # the new tokens it reserved (read-only: the caller's when it was, else a copy)
    rows: np.ndarray  # the requests' table rows
    need: int  # pages it took off the free stack
    before: np.ndarray  # [2, R]: each row's tokens and pages before (0 for a new sequence)
    created: list[bool] | None  # which requests it made a new sequence for (None: all)

    def undoes(self, seq_ids) -> bool:
        """Whether a rollback of ``seq_ids`` is this reservation's (the same ids, in order)."""
        return type(seq_ids) is list and seq_ids == self.ids


def _frozen_copy(a: np.ndarray) -> np.ndarray:
    out = a.copy()
    out.setflags(write=False)
    return out


class PageAllocator:
    """``num_pages`` pages of ``page_size`` tokens (page 0 the scratch page), handed to
    sequences through the dense table (a sequence at most ``max_pages_per_seq``)."""

    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int | None = None) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if max_pages_per_seq is None:
            max_pages_per_seq = num_pages - 1
        if max_pages_per_seq < 1:
            raise ValueError(f"max_pages_per_seq must be >= 1, got {max_pages_per_seq}")
        self.num_pages, self.page_size = num_pages, page_size
        self.table = PageTable(max_pages_per_seq, page_size)
        self.cache_id = uuid.uuid4().hex  # stamped on every handle of this cache
        # the free pages, a LIFO stack: _free[:_num_free], top last (recently freed
        # pages are reused first: warm in cache); page 1 is handed out first
        self._free = np.arange(num_pages - 1, SCRATCH_PAGE, -1, dtype=np.int32)
        self._num_free = num_pages - 1
        #: the last reservation, while nothing else changed (what a failed forward undoes)
        self.last: Reservation | None = None

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

    def pages(self, tokens: np.ndarray) -> np.ndarray:
        """:meth:`pages_for` of every entry of a non-negative integer array (a new array)."""
        shift = self.table.page_shift
        if shift >= 0:  # a power-of-two page: an add and a shift
            out = tokens + (self.page_size - 1)
            out >>= shift
            return out
        return -(-tokens // self.page_size)

    def stored_tokens(self) -> int:
        """Tokens whose KV this pool holds for live sequences."""
        return int(self.table.row_tokens.sum())  # free rows hold 0

    def stored_pages(self) -> int:
        """Pages this pool has handed out (scratch excluded)."""
        return self.num_pages - 1 - self._num_free

    def snapshot(self) -> tuple:
        """Allocator state, for tests that assert a failed call changed nothing: the free
        stack (bottom first) and each live sequence's (id, tokens, pages)."""
        free = tuple(self._free[: self._num_free].tolist())
        t = self.table
        rt = t.row_tokens
        return free, tuple((k, int(rt[r]), t.pages_of_row(r)) for k, r in sorted(t.live().items()))

    # ---- reservation ----------------------------------------------------------
    def reserve(self, prefixes: list, rows: np.ndarray | None, new: np.ndarray) -> tuple[list[int], np.ndarray]:
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
        t = self.table
        while True:
            need, wide, fresh, done = _reserve_pages(
                _NO_ROWS if all_new else rows, all_new, new, self.page_size, t.row_tokens, t.row_pages,
                t.cells, self._free, self._num_free, t.free_rows, t.num_free_rows, taken, before)
            if done or wide >= 0 or need > self._num_free:
                break
            t.grow(2 * t.cells.shape[0])  # too few free rows: double them, count again
        if wide >= 0:
            self._refuse_width(prefixes, rows, new, self.pages(before[0] + new))
        if not done:
            raise KVCacheFull(
                f"KV cache full: the batch needs {need} more pages of {self.page_size} tokens, "
                f"{self._num_free} are free (pool of {self.num_pages - 1} usable pages)", "kv_tokens"
            )
        first = t.next_id
        t.next_id = first + fresh
        self._num_free -= need
        t.num_free_rows -= fresh
        live = t.live()  # (the previous reservation's deferred entries, written now)
        taken.setflags(write=False)  # the caller's copy and the undo's: read-only
        if all_new:
            created = None
            ids = list(range(first, first + num))
        else:
            created = (rows < 0).tolist()
            fresh_ids = iter(range(first, first + fresh))
            ids = [next(fresh_ids) if h is None else h.seq_id for h in prefixes]
            live.update(zip(range(first, first + fresh), compress(taken.tolist(), created)))
        self.last = last = Reservation(ids[:], new if not new.flags.writeable else _frozen_copy(new), taken, need,
                                       before, created)
        if created is None:  # every request new: their id -> row entries wait for the first read
            t.pending = (last.ids, taken)
        return ids, taken

    def reserve_next(self, handles: list, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> list[int]:
        """A decode step's :meth:`reserve`: one more token in each live row ``rows[i]``
        (``handles[i]``'s; distinct rows), all or nothing, as :meth:`reserve` of ones
        would take it (the same pages, in the same order; undone the same way). One
        compiled call (:func:`_reserve_next`) also writes each token's position (the
        row's tokens before) into ``positions`` and its cache slot into ``slots``.
        Returns the sequence ids."""
        num = rows.shape[0]
        before = np.empty((2, num), dtype=np.int64)
        t = self.table
        need, wide, done = _reserve_next(rows, self.page_size, t.row_tokens, t.row_pages, t.cells, self._free,
                                         self._num_free, before, positions, slots)
        ones = ones_of(num)
        if wide >= 0:
            self._refuse_width(handles, rows, ones, self.pages(before[0] + ones))
        if not done:
            raise KVCacheFull(
                f"KV cache full: the batch needs {need} more pages of {self.page_size} tokens, "
                f"{self._num_free} are free (pool of {self.num_pages - 1} usable pages)", "kv_tokens"
            )
        self._num_free -= need
        t.live()  # (the previous reservation's deferred entries, written now)
        ids = list(map(_seq_id_of, handles))
        taken = rows if not rows.flags.writeable else _frozen_copy(rows)
        self.last = Reservation(ids[:], ones, taken, need, before, [False] * num)
        return ids

    def _refuse_width(self, prefixes: list, rows: np.ndarray | None, new: np.ndarray,
                      total_pages: np.ndarray) -> None:
        """KVCacheFull naming the first request that needs more pages than a table row holds."""
        t = self.table
        width = t.width
        i = int(np.argmax(total_pages > width))
        old = rows is not None and rows[i] >= 0
        what = f"sequence {prefixes[i].seq_id}" if old else "a new sequence"
        have = int(t.row_tokens[rows[i]]) if old else 0
        raise KVCacheFull(
            f"KV cache full: request {i} ({what}, {have} + {int(new[i])} tokens) needs {int(total_pages[i])} "
            f"pages of {self.page_size} tokens, the page table holds at most {width} per sequence"
        )

    def rollback(self, seq_ids: list[int], new_tokens) -> None:
        """Undo a :meth:`reserve` (a forward that failed after reserving): give back each
        sequence's last ``new_tokens[i]`` tokens and drop the sequences it created. The
        pages go back in reverse pop order and the rows likewise, so the free lists
        (their order included) are exactly what they were before the reservation."""
        last = self.last
        new = new_tokens if last is not None and new_tokens is last.new else np.asarray(new_tokens, dtype=np.int64)
        if last is not None and last.undoes(seq_ids) and (new is last.new or np.array_equal(new, last.new)):
            self.undo_last()
            return
        rows = self.table.rows_of(seq_ids)
        tokens = self.table.row_tokens[rows]
        tokens -= new
        self.undo(seq_ids, rows, tokens, tokens == 0)

    def undo_last(self) -> None:
        """Undo the last :meth:`reserve` when nothing changed since (what a failed forward
        undoes): its pages still lie above the free stack's top, in order, so the undo
        clears what it wrote and puts back each row's counts."""
        last, self.last = self.last, None
        rows, t = last.rows, self.table
        _clear_pages(t.cells, t.row_tokens, t.row_pages, rows, last.before)
        self._num_free += last.need
        t.forget(last.ids, rows, last.created)

    def undo(self, seq_ids, rows: np.ndarray, tokens: np.ndarray, drop: np.ndarray) -> None:
        """Shrink row ``rows[i]`` to ``tokens[i]`` tokens (its pages past them back on the
        free stack, the batch's last page first) and drop the sequences marked in ``drop``
        (created by the undone reservation)."""
        self.last = None
        t = self.table
        self._num_free = _shrink_rows(t.cells, t.row_tokens, t.row_pages, self._free, self._num_free,
                                      rows, tokens, self.page_size)
        t.forget(seq_ids, rows, drop.tolist())

    def release(self, seq_id: int) -> int | None:
        """Give back a live sequence's pages (top of the free stack, its last page
        deepest) and its row; the row it had, or None when it is not live."""
        t = self.table
        row = t.live().pop(seq_id, None)
        if row is None:
            return None
        self.last = None
        n, top = int(t.row_pages[row]), self._num_free
        self._free[top : top + n] = t.cells[row, :n][::-1]
        self._num_free = top + n
        t.free_row(row)
        return row


_NO_ROWS = np.zeros(0, dtype=np.int64)  # the rows argument of an all-new batch (not read)
_ONES: dict[int, np.ndarray] = {}
_seq_id_of = attrgetter("seq_id")


def ones_of(n: int) -> np.ndarray:
    """A read-only int64 array of ``n`` ones, the same object for every call with ``n``:
    a decode step's new tokens, which its undo passes back (:meth:`PageAllocator.rollback`
    then knows it by identity, without comparing)."""
    got = _ONES.get(n)
    if got is None:
        got = _ONES[n] = np.ones(n, dtype=np.int64)
        got.setflags(write=False)
    return got


@host_kernel
def _reserve_next(rows, page_size, row_tokens, row_pages, table, free, num_free, before, positions, slots):
    """:func:`_reserve_pages` of one new token in each of the live, distinct ``rows``:
    counts first (``before`` [2, R]: each row's tokens and pages before), returns
    ``(pages needed, first request wider than a table row or -1, done)``; only when all
    fit it takes the pages (request 0's first, off the top of ``free[:num_free]``) and
    writes each token's position (its row's tokens before) and cache slot."""
    width = table.shape[1]
    need = 0
    wide = -1
    for i in range(rows.shape[0]):
        row = rows[i]
        tokens, pages = row_tokens[row], row_pages[row]
        before[0, i], before[1, i] = tokens, pages
        after = (tokens + page_size) // page_size
        need += after - pages
        if wide < 0 and after > width:
            wide = i
    if wide >= 0 or need > num_free:
        return need, wide, False
    top = num_free
    for i in range(rows.shape[0]):
        row = rows[i]
        tokens, pages = before[0, i], before[1, i]
        after = (tokens + page_size) // page_size
        if after > pages:
            top -= 1
            table[row, pages] = free[top]
            row_pages[row] = after
        row_tokens[row] = tokens + 1
        positions[i] = tokens
        slots[i] = table[row, tokens // page_size] * page_size + tokens % page_size
    return need, wide, True


@host_kernel
def _reserve_pages(prefix_rows, all_new, new, page_size, row_tokens, row_pages, table, free, num_free, free_rows,
                   num_free_rows, taken, before):
    """:meth:`PageAllocator.reserve`'s work: request ``i`` extends table row
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
