"""Interleave layout: round-robin over the flattened batch.

Rank ``r`` owns global rows ``r, r + C, r + 2C, ...`` of the whole batch (the
round-robin does not restart per request), in ascending order. Positions keep
their original values. Every owned row is its own segment ``(j, 1, position + 1)``,
so a rank has as many segments as rows.

Balance is near perfect for long requests, but the per-row segments make it a
poor fit for kernels that want long query runs; it is the simple baseline the
zigzag layout is compared against.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from graphcp.cp.base import Layout, Plan, RankPlan, arange, freeze

__all__ = ["InterleaveLayout", "InterleavePlan"]


class InterleavePlan(Plan):
    """Plan of the interleave layout (see the module docstring)."""

    layout_name = "interleave"

    def __init__(self, cp_size: int, extend_lens: np.ndarray, prefix_lens: np.ndarray) -> None:
        super().__init__(cp_size, extend_lens, prefix_lens, int(np.add.reduce(extend_lens)))
        c = cp_size
        t = self.num_tokens
        # rank r owns ceil((T - r) / C) rows
        self._set_local_rows([(t - r + c - 1) // c for r in range(c)])

    def _build_rank(self, r: int) -> RankPlan:
        rows = arange(self.num_tokens)[r :: self.cp_size].copy()
        n = rows.shape[0]
        row_request = np.searchsorted(self.cu_extend, rows, side="right") - 1
        positions = rows + (self.prefix_lens - self.cu_extend[:-1])[row_request]
        q = np.ones(n, dtype=np.int64)
        kv = positions + 1
        cu = np.arange(n + 1, dtype=np.int32)
        local = arange(n)
        shift = np.stack([rows - local, positions - local])  # every segment one row
        freeze(rows, row_request, positions, q, kv, cu, shift)
        return RankPlan(r, row_request, q, kv, cu, shift, rows, positions, row_request)

    # Global row g = i * C + r lives on rank r at local index i: viewed as an
    # [ceil(T / C), C] grid, every global map is a broadcast, trimmed to T.

    def _grid(self, col: np.ndarray, row: np.ndarray) -> np.ndarray:
        out = np.add(row[:, None], col[None, :]).reshape(-1)[: self.num_tokens]
        return out

    @cached_property
    def owner(self) -> np.ndarray:  # type: ignore[override]
        c = self.cp_size
        out = self._grid(arange(c), np.zeros(-(-self.num_tokens // c), dtype=np.int64))
        freeze(out)
        return out

    @cached_property
    def local_index(self) -> np.ndarray:  # type: ignore[override]
        c = self.cp_size
        out = self._grid(np.zeros(c, dtype=np.int64), arange(-(-self.num_tokens // c)))
        freeze(out)
        return out

    def gather_index(self, capacity: int) -> np.ndarray:
        cap = self._check_capacity(capacity)
        c = self.cp_size
        return self._grid(arange(c) * cap, arange(-(-self.num_tokens // c)))

    @cached_property
    def _last(self) -> tuple[np.ndarray, np.ndarray]:
        last = self.cu_extend[1:] - 1
        owner, local = last % self.cp_size, last // self.cp_size
        freeze(owner, local)
        return owner, local

    @property
    def last_owner(self) -> np.ndarray:  # type: ignore[override]
        return self._last[0]

    @property
    def last_local_index(self) -> np.ndarray:  # type: ignore[override]
        return self._last[1]


class InterleaveLayout(Layout):
    """Interleave CP layout: rank r owns flattened rows r, r+C, r+2C, ..."""

    name = "interleave"

    def _plan(self, extend_lens: np.ndarray, prefix_lens: np.ndarray, min_extend: int) -> InterleavePlan:
        return InterleavePlan(self.cp_size, extend_lens, prefix_lens)
