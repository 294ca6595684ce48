"""The dense page table of a paged cache (one part of its allocator, graphcp.kv.allocator).

One ``int32`` table ``[rows, width]``: each live sequence owns a row holding its pages
followed by the scratch page, with the row's page and token counts beside it. The table
*is* the page lists, so the per-forward :meth:`PageTable.page_table` is one numpy
gather, not a Python loop per request. Rows are recycled (a LIFO stack of free rows, low
rows first); when too few are free the table doubles its rows.

A token at local index ``i`` of a sequence lives in page ``pages[i // page_size]`` at
offset ``i % page_size``; its *slot* is ``page * page_size + offset``. Page 0 is the
scratch page: it is never handed to a request, so a write aimed at slot -1 (padding)
can be redirected to slot 0 and keep the write's shape static.
"""

from __future__ import annotations

from collections import deque
from itertools import compress

import numpy as np

SCRATCH_PAGE = 0
_INITIAL_ROWS = 16


def page_shift(page_size: int) -> int:
    """log2 of ``page_size`` when it is a power of two, else -1 (shifts beat divisions ~10x)."""
    return page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1


class PageTable:
    """The dense table, its rows' counts, the free rows and the live sequence ids' rows.

    The arrays are public to the allocator and the placements, which update them in
    compiled kernels; each is reallocated when the table grows (:meth:`grow`), so read
    them from here at every use."""

    def __init__(self, width: int, page_size: int) -> None:
        self.page_size, self.page_shift = page_size, page_shift(page_size)
        #: [rows, width] int32: each live row's pages, then scratch
        self.cells = np.full((_INITIAL_ROWS, width), SCRATCH_PAGE, dtype=np.int32)
        #: per row, its sequence's page and token counts (0 when free)
        self.row_pages = np.zeros(_INITIAL_ROWS, dtype=np.int64)
        self.row_tokens = np.zeros(_INITIAL_ROWS, dtype=np.int64)
        #: the free rows, a LIFO stack like the pages': free_rows[:num_free_rows], low rows first
        self.free_rows = np.arange(_INITIAL_ROWS - 1, -1, -1, dtype=np.int64)
        self.num_free_rows = _INITIAL_ROWS
        self.next_id = 0  # the next sequence id (ids are never reused: a released handle stays dead)
        #: (ids, rows) of an all-new reservation not yet in the id -> row map (:meth:`live`)
        self.pending: tuple[list[int], np.ndarray] | None = None
        self._rows: dict[int, int] = {}
        self._view = np.zeros(0, dtype=np.int32)  # the read-only view :attr:`view` hands out (on first use)

    @property
    def width(self) -> int:
        """Most pages one sequence may hold (the table's columns)."""
        return self.cells.shape[1]

    @property
    def view(self) -> np.ndarray:
        """The table as a read-only view. Row ``r`` is valid only while its sequence is
        live; the table is reallocated when it grows, so do not hold the view across a
        reservation."""
        view = self._view
        if view.base is not self.cells:  # the table grew: a new view of it
            view = self._view = self.cells.view()
            view.flags.writeable = False
        return view

    def grow(self, rows: int) -> None:
        """Make the table (and every per-row array) ``rows`` rows long; new rows free."""
        n, w = self.cells.shape
        cells = np.full((rows, w), SCRATCH_PAGE, dtype=np.int32)
        cells[:n] = self.cells
        self.cells = cells
        self.row_pages = np.concatenate([self.row_pages, np.zeros(rows - n, dtype=np.int64)])
        self.row_tokens = np.concatenate([self.row_tokens, np.zeros(rows - n, dtype=np.int64)])
        # the new rows go under the free ones, handed out low first after them
        free, height = np.empty(rows, dtype=np.int64), self.num_free_rows
        free[: rows - n] = np.arange(rows - 1, n - 1, -1)
        free[rows - n : rows - n + height] = self.free_rows[:height]
        self.free_rows, self.num_free_rows = free, rows - n + height

    def live(self) -> dict[int, int]:
        """Live sequence id -> table row. An all-new reservation's entries are written on
        the first read after it (by then its forward ran: the handles read them), so a
        batch that is undone before (a failed forward) never writes them: no per-request
        dict work on the path to the first launch."""
        pending = self.pending
        if pending is not None:
            self.pending = None
            self._rows.update(zip(pending[0], pending[1].tolist()))
        return self._rows

    def forget(self, seq_ids, rows: np.ndarray, drop: list[bool] | None) -> None:
        """Forget the sequences marked in ``drop`` (None: all) and push their rows, last
        first (the row stack as it was before the reservation that took them)."""
        if drop is None or all(drop):
            gone, gone_rows = seq_ids, rows[::-1]
        elif any(drop):
            gone, gone_rows = list(compress(seq_ids, drop)), list(compress(rows.tolist(), drop))[::-1]
        else:
            return
        pending = self.pending
        if pending is not None and pending[0] is gone:  # the entries were never written: nothing to forget
            self.pending = None
        else:
            deque(map(self.live().__delitem__, gone), maxlen=0)  # (a C-level loop)
        height = self.num_free_rows
        self.num_free_rows = height + len(gone_rows)
        self.free_rows[height : self.num_free_rows] = gone_rows

    def free_row(self, row: int) -> None:
        """Clear a released sequence's row (its pages already given back) and push it."""
        self.cells[row, : self.row_pages[row]] = SCRATCH_PAGE
        self.row_pages[row] = self.row_tokens[row] = 0
        self.free_rows[self.num_free_rows] = row
        self.num_free_rows += 1

    def pages_of_row(self, row: int, known: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The row's pages. ``known``: its first pages as read earlier (a current handle's
        of the sequence, which a decode step only extends): reused, only the pages past
        them read (a handle of a long request is thousands of pages, a step adds one)."""
        n, k = int(self.row_pages[row]), len(known)
        if k and k <= n and self.cells[row, k - 1] == known[-1]:
            return known if n == k else known + tuple(self.cells[row, k:n].tolist())
        return tuple(self.cells[row, :n].tolist())

    # ---- the per-forward gathers ----------------------------------------------------
    def rows_of(self, seq_ids: list[int]) -> np.ndarray:
        """[len(seq_ids)] int64: each live sequence's row of the table."""
        return np.fromiter(map(self.live().__getitem__, seq_ids), np.int64, len(seq_ids))

    def page_table(self, seq_ids: list[int], width: int | None = None) -> np.ndarray:
        """[len(seq_ids), width] int32 page ids, padded with the scratch page (a fresh
        array). ``width`` defaults to the most pages any of these sequences holds (>= 1)."""
        rows = self.rows_of(seq_ids)
        n_pages = self.row_pages.take(rows).tolist()  # max() of a short list beats a numpy reduction
        most = max(n_pages, default=0)
        if width is None:
            width = max(most, 1)
        elif most > width:
            i = next(i for i, n in enumerate(n_pages) if n > width)
            raise ValueError(f"sequence {seq_ids[i]} has {n_pages[i]} pages, page table width is {width}")
        return self.page_table_rows(rows, width)

    def page_table_rows(self, rows: np.ndarray, width: int, out: np.ndarray | None = None) -> np.ndarray:
        """:meth:`page_table` from :meth:`rows_of`, unchecked (the hot path): a
        [len(rows), width] int32 array (``out`` when given); columns past :attr:`width`
        are scratch."""
        cells = self.cells
        w = cells.shape[1]
        if width <= w:
            # take: faster than cells[rows, :width]; into out, no second copy
            return cells[:, :width].take(rows, axis=0, out=out)
        if out is None:
            out = np.empty((len(rows), width), dtype=np.int32)
        out[:, w:] = SCRATCH_PAGE
        cells.take(rows, axis=0, out=out[:, :w])
        return out

    def slots(self, seq_rows: np.ndarray, positions: np.ndarray, run_request: np.ndarray,
              run_length: np.ndarray) -> np.ndarray:
        """int64 [n]: the cache slot of each token, ``page * page_size + position % page_size``.

        The tokens come in runs (a rank's segments, say): run ``s`` is ``run_length[s]``
        consecutive tokens of request ``run_request[s]``, and ``seq_rows[j]`` is request
        ``j``'s row of the table (:meth:`rows_of`). The pages must be reserved. Per
        token: one add, one table lookup and a few bit operations.
        """
        return self.run_slots(seq_rows[run_request], positions, run_length)

    def run_slots(self, run_rows: np.ndarray, positions: np.ndarray, run_length: np.ndarray) -> np.ndarray:
        """:meth:`slots` with each run's table row given (``run_rows[s]``: the row of run
        ``s``'s request), for a caller that gathered them already (the page table's)."""
        ps, cells = self.page_size, self.cells
        # virtual position: a request's positions offset by its table row, so that
        # vpos // page_size indexes the flattened table and vpos % page_size is the offset
        base = run_rows * (cells.shape[1] * ps)
        vpos = base.repeat(run_length)
        vpos += positions
        flat = cells.reshape(-1)
        shift = self.page_shift
        if shift >= 0:  # a power-of-two page: shifts and masks, not divisions
            out = np.left_shift(flat.take(vpos >> shift), shift, dtype=np.int64)
            vpos &= ps - 1
            out |= vpos
        else:
            out = np.multiply(flat.take(vpos // ps), ps, dtype=np.int64)
            vpos %= ps
            out += vpos
        return out
