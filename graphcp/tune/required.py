"""Required local rows per batch, vectorised over a whole workload.

The bucket a batch needs is decided by its largest rank's local rows (all ranks
share the plan, so they agree). This module computes that number for every batch
at once, with the same arithmetic as the layouts in ``graphcp.cp``:

- zigzag: a request of L new tokens is cut into 2C blocks, ``base = L // 2C`` and
  the first ``rem = L % 2C`` blocks one longer; rank r owns blocks r and 2C-1-r, so
  it gets ``2*base + [r < rem] + [2C-1-r < rem]`` rows of that request.
- interleave: rank r owns flattened rows r, r+C, ... of the batch, so rank 0 has
  the most: ``ceil(T / C)`` for T new tokens in the batch.

No Python loop runs over batches or requests: 100k batches take milliseconds.
"""

from __future__ import annotations

import numpy as np

from graphcp.options import LAYOUTS
from graphcp.tune.workload import Workload


def zigzag_rank_rows(extend: np.ndarray, offsets: np.ndarray, cp_size: int) -> np.ndarray:
    """(n_batches, C) local rows of every rank for every batch under zigzag.

    Summed over the requests of a batch, rank r gets
    ``2*sum(base) + #{rem > r} + #{rem > 2C-1-r}``. So per batch we only need the
    histogram of ``rem`` over its 2C values: G[b, k] = #requests of b with rem > k.
    """
    c2 = 2 * cp_size
    n_batches = len(offsets) - 1
    base, rem = np.divmod(extend, c2)
    base_sum = np.add.reduceat(base, offsets[:-1])
    batch_of = np.repeat(np.arange(n_batches), np.diff(offsets))
    hist = np.bincount(batch_of * c2 + rem, minlength=n_batches * c2).reshape(n_batches, c2)
    # G[:, k] = sum of hist[:, k+1:]: requests whose remainder reaches block k
    gt = np.cumsum(hist[:, ::-1], axis=1)[:, ::-1] - hist
    r = np.arange(cp_size)
    return 2 * base_sum[:, None] + gt[:, r] + gt[:, c2 - 1 - r]


def interleave_rank_rows(extend: np.ndarray, offsets: np.ndarray, cp_size: int) -> np.ndarray:
    """(n_batches, C) local rows of every rank under interleave: ceil((T - r) / C)."""
    t = np.add.reduceat(extend, offsets[:-1])
    r = np.arange(cp_size)
    return np.maximum(-(-(t[:, None] - r) // cp_size), 0)


def rank_rows(workload: Workload, cp_size: int, layout: str = "zigzag") -> np.ndarray:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if layout == "zigzag":
        return zigzag_rank_rows(workload.extend, workload.offsets, cp_size)
    if layout == "interleave":
        return interleave_rank_rows(workload.extend, workload.offsets, cp_size)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


#: zigzag works on (batches, 2C) arrays; batches are taken in blocks of about this many cells
_BLOCK_CELLS = 1 << 22


def required_rows(workload: Workload, cp_size: int, layout: str = "zigzag") -> np.ndarray:
    """Largest rank's local rows per batch (raw, not aligned): what BucketSet.select receives."""
    if layout == "interleave":  # rank 0 always has the most; skip the (n, C) matrix
        if cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {cp_size}")
        t = workload.batch_tokens()
        return -(-t // cp_size)
    if layout != "zigzag" or workload.n_batches * 2 * cp_size <= _BLOCK_CELLS:
        return rank_rows(workload, cp_size, layout).max(axis=1)
    # large C: blocks of batches, so memory stays bounded by the block, not batches x 2C
    block = max(1, _BLOCK_CELLS // (2 * cp_size))
    offs, out = workload.offsets, []
    for b0 in range(0, workload.n_batches, block):
        b1 = min(workload.n_batches, b0 + block)
        lo, hi = offs[b0], offs[b1]
        out.append(zigzag_rank_rows(workload.extend[lo:hi], offs[b0 : b1 + 1] - lo, cp_size).max(axis=1))
    return np.concatenate(out)
