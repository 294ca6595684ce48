"""The KV slot mapping of a rank-major all-gather, computed per page run.

Every rank writes the K/V of *all* the batch's new tokens into its own paged cache
(DESIGN.md, "KV exchange"): row ``i`` of the all-gather, padded to ``capacity``
rows per rank, goes to cache slot ``slots[i]`` (-1 for a padding row). That is
``C * capacity`` entries per forward, so computing it token by token (page-table
lookup, divide, multiply, add per row) dominated the host cost of a forward.

A plan's :class:`~graphcp.cp.base.GatherBlocks` list its rows as runs of
consecutive positions of one request. Cut each block again at page boundaries and
every *run* is contiguous in the cache too: ``slot = value + gathered row`` with one
``value`` per run. The per-run work is a few dozen numpy calls on arrays of about
``blocks + tokens / page_size`` entries; the per-token work is one ``repeat`` and
one ``add``, written straight into the caller's buffer.

Runs are located in the page table with *virtual positions*: the position of a
token of request ``j`` plus ``row_j * width * page_size`` (``row_j``: the request's
row of the cache's dense ``[rows, width]`` page table), so that ``vpos // page_size``
indexes the flattened table directly and ``vpos % page_size`` is the offset.
"""

from __future__ import annotations

import numpy as np

from graphcp.cp.base import GatherBlocks, arange

__all__ = ["gathered_slots"]


def gathered_slots(
    blocks: GatherBlocks,
    local_rows: list[int],
    capacity: int,
    seq_rows: np.ndarray,
    table: np.ndarray,
    page_size: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """int64 ``[len(local_rows) * capacity]``: the cache slot of every row of the
    rank-major all-gather, -1 for padding rows.

    ``blocks`` come from ``plan.gather_blocks`` (rank-major, ascending gathered
    rows), ``local_rows`` from ``plan.local_rows``; ``seq_rows[j]`` is request
    ``j``'s row of the dense page ``table`` (``PagedKVCache.table``), whose pages
    must cover every position the plan names. Writes into ``out`` when given.
    """
    cp_size = len(local_rows)
    total = cp_size * capacity
    if out is None:
        out = np.empty(total, dtype=np.int64)
    elif out.shape != (total,) or out.dtype != np.int64:
        raise ValueError(f"out must be int64 [{total}] (C * capacity), got {out.dtype} {list(out.shape)}")
    if max(local_rows) > capacity:
        raise ValueError(f"capacity {capacity} is smaller than the largest rank's {max(local_rows)} rows")
    ps = page_size
    q = blocks.length
    num_blocks = q.shape[0]
    # virtual start of each block, and the number of pages (runs) it touches
    v0 = seq_rows[blocks.request]
    v0 *= table.shape[1] * ps
    v0 += blocks.position
    first_page = v0 // ps
    runs = v0 + q
    runs += ps - 1
    runs //= ps
    runs -= first_page
    np.minimum(runs, q, out=runs)  # an empty block has no run
    run_end = np.add.accumulate(runs)
    num_runs = int(run_end[-1])
    # per block, what its runs start from: page - run index, virtual start,
    # gathered row - virtual start (one array, so one repeat gives all three per run)
    per_block = np.empty((3, num_blocks), dtype=np.int64)
    np.subtract(first_page, run_end, out=per_block[0])
    per_block[0] += runs
    per_block[1] = v0
    np.multiply(blocks.owner, capacity, out=per_block[2])
    per_block[2] += blocks.local_start
    per_block[2] -= v0
    page, start, row = per_block.repeat(runs, axis=1)
    page += arange(num_runs)  # flat page-table index of each run
    np.maximum(start, page * ps, out=start)  # virtual position of the run's first token
    row += start  # its gathered row
    value = np.multiply(table.reshape(-1)[page], ps, dtype=np.int64)  # page's first slot
    start %= ps
    value += start
    value -= row  # slot = value + gathered row, along the run
    # each run extends to the next one's first row; the last, and any padding
    # after a rank's rows, are overwritten with -1 below
    length = np.empty(num_runs, dtype=np.int64)
    np.subtract(row[1:], row[:-1], out=length[:-1])
    first_row = int(row[0])
    length[-1] = total - int(row[-1])
    np.add(value.repeat(length), arange(total)[first_row:], out=out[first_row:])
    out[:first_row] = -1
    for r, n in enumerate(local_rows):
        if n < capacity:
            out[r * capacity + n : (r + 1) * capacity] = -1
    return out
