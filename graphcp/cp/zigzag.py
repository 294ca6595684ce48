"""Zigzag layout: causal load balance by pairing an early and a late block.

Each request's new tokens are split separately into ``2C`` contiguous blocks:
``base = L // 2C`` tokens each, and the first ``L % 2C`` blocks get one more.
Rank ``r`` owns block ``r`` (early) and block ``2C - 1 - r`` (late). Early tokens
see little history and late tokens see a lot, so every rank gets about the same
causal attention work (max/mean close to 1 once ``L >> 2C``).

Rank ``r``'s local order: for each request in batch order, its early block's rows
then its late block's rows. Its segments, two per request in the same order:

* early ``(j, |block r|, prefix_j + |block 0..r|)``
* late  ``(j, |block 2C-1-r|, prefix_j + |block 0..2C-1-r|)``

Both are always emitted, empty or not (a request shorter than ``2C`` leaves some
blocks empty), so every rank has exactly ``2 * R`` segments: a static metadata
shape for captured graphs; kernels skip empty segments.

Example: C = 4, extend lengths [1534, 161, 353], no prefix -> local rows
[513, 511, 512, 512].

Block k of a request of length L has ``(L + 2C-1-k) // 2C`` rows (the same rule,
without a branch). The plan is computed at block granularity (``R * 2C`` blocks)
by one compiled kernel (:mod:`graphcp.jit`); a rank's plan is views of its result.
"""

from __future__ import annotations

from functools import cached_property, lru_cache

import numpy as np

from graphcp.cp.base import Layout, Plan, RankPlan, arange, freeze
from graphcp.jit import host_kernel

__all__ = ["ZigzagLayout", "ZigzagPlan", "rank_token_counts"]


def rank_token_counts(cp_size: int, extend_lens: np.ndarray) -> np.ndarray:
    """int64 [C, R]: new tokens each rank owns of each request (its early block r plus
    its late block 2C-1-r; the rule above), without planning the batch: what a
    token-sharded KV cache reserves on each rank."""
    c2 = 2 * cp_size
    # [2C, R]: numpy's inner loops run over the requests, not over a request's few blocks
    sizes = _size_offset(c2)[:, None] + np.asarray(extend_lens, dtype=np.int64)
    _floor_div(sizes, c2)
    return sizes[:cp_size] + sizes[: cp_size - 1 : -1]


@lru_cache(maxsize=64)
def _size_offset(c2: int) -> np.ndarray:
    """2C-1-k per block k (read-only; see the module doc's rule)."""
    out = np.arange(c2 - 1, -1, -1, dtype=np.int64)
    out.setflags(write=False)
    return out


def _floor_div(a: np.ndarray, d: int) -> None:
    """``a //= d`` in place for non-negative ``a``: a shift when ``d`` is a power of two
    (numpy's integer division costs ~1 ns an element; at hundreds of requests, microseconds)."""
    if d & (d - 1) == 0:
        a >>= d.bit_length() - 1
    else:
        a //= d


class _BatchTables:
    """Index constants for one ``(cp_size, num_requests)``.

    Blocks are enumerated two ways. *Global* order ``b = j * 2C + k`` (block ``k``
    of request ``j``) is the order of the batch's rows. *Rank-major* order
    ``f = r * 2R + 2j + e`` concatenates every rank's local order: for each request
    ``j``, rank ``r``'s early block ``r`` (``e = 0``) then its late block
    ``2C-1-r`` (``e = 1``). A rank's 2R segments are a contiguous slice of it.
    """

    __slots__ = (
        "rm_of_global",
        "owner_global",
        "seg_request",
        "last_owner",
        "last_rm",
        "request_x2",
        "zeros",
    )

    def __init__(self, cp_size: int, num_requests: int) -> None:
        c, c2, num = cp_size, 2 * cp_size, num_requests
        r = np.arange(c, dtype=np.int64)[:, None, None]
        j = np.arange(num, dtype=np.int64)[None, :, None]
        e = np.arange(2, dtype=np.int64)[None, None, :]
        k_rm = np.where(e == 0, r, c2 - 1 - r)  # [C, 1, 2]: block k of each (r, e)
        self.zeros = np.zeros(num, dtype=np.int64)
        #: rank-major index of each global block (the inverse of global_of_rm)
        global_of_rm = (j * c2 + k_rm).ravel()
        self.rm_of_global = np.empty_like(global_of_rm)
        self.rm_of_global[global_of_rm] = np.arange(c * num * 2, dtype=np.int64)
        k = np.arange(c2, dtype=np.int64)
        owner = np.where(k < c, k, c2 - 1 - k)
        #: owner rank of each block, global order
        self.owner_global = np.tile(owner, num)
        #: request of each of a rank's 2R segments
        self.seg_request = np.repeat(np.arange(num, dtype=np.int64), 2)
        # A request's last token is in block 2C-1 unless the request is shorter than
        # 2C; then blocks 0..L-1 hold one token each and it is in block L-1. Indexed
        # by m = min(L, 2C), i.e. block m - 1 (entry 0 unused):
        k_last = np.concatenate([[0], k])
        #: owner of the last token
        self.last_owner = owner[k_last]
        #: rank-major index of its block for request 0 (add 2j for request j)
        self.last_rm = np.where(k_last < c, k_last * 2 * num, (c2 - 1 - k_last) * 2 * num + 1)
        self.request_x2 = 2 * np.arange(num, dtype=np.int64)
        freeze(self.rm_of_global)
        freeze(self.owner_global, self.seg_request, self.last_owner, self.last_rm)
        freeze(self.request_x2, self.zeros)


class _ZigzagTables:
    """Per-``cp_size`` cache of per-batch-size index tables."""

    __slots__ = ("cp_size", "_batch")

    _MAX_CACHED = 256

    def __init__(self, cp_size: int) -> None:
        self.cp_size = cp_size
        self._batch: dict[int, _BatchTables] = {}

    def batch(self, num_requests: int) -> _BatchTables:
        tab = self._batch.get(num_requests)
        if tab is None:
            tab = _BatchTables(self.cp_size, num_requests)
            if len(self._batch) >= self._MAX_CACHED:
                self._batch.clear()
            self._batch[num_requests] = tab
        return tab


@host_kernel
def _zigzag_blocks(extend_lens, prefix_lens, cp_size, buf, cu):
    """The plan at block granularity (see :class:`ZigzagPlan`), written into ``buf``:
    first ``per_block`` [6, R * 2C], the block sizes in global block order (row 0),
    then rank-major the sizes (row 1: the segments' q_lens), local ends (2), global
    row - local index (3), position - local index (4) and the keys each block's last
    row sees (5); then each rank's local rows [C] and the largest q_len and kv_len of
    its segments [C, 2]; each rank's segment offsets into ``cu`` [C, 2R + 1] (int32).
    Returns the batch's tokens."""
    c2 = 2 * cp_size
    num = extend_lens.shape[0]
    nseg = 2 * num
    blocks = nseg * cp_size
    per_block = buf[: 6 * blocks].reshape(6, blocks)
    # per request: its first global row and its blocks' base size and remainder (block k
    # has base + 1 rows for k < remainder), so every block's size and global end is O(1)
    start = np.empty(num, dtype=np.int64)
    base = np.empty(num, dtype=np.int64)
    extra = np.empty(num, dtype=np.int64)
    end = 0
    for j in range(num):
        start[j] = end
        base[j], extra[j] = extend_lens[j] // c2, extend_lens[j] % c2
        end += extend_lens[j]
        for k in range(c2):  # global block order
            per_block[0, j * c2 + k] = base[j] + 1 if k < extra[j] else base[j]
    # rank-major, written in order (rank r's early block r and late block 2C-1-r of each request)
    for r in range(cp_size):
        local = most_q = most_kv = 0
        cu[r, 0] = 0
        for j in range(num):
            for e in range(2):
                k = r if e == 0 else c2 - 1 - r
                n = base[j] + 1 if k < extra[j] else base[j]
                global_end = start[j] + (k + 1) * base[j] + min(k + 1, extra[j])
                kv = global_end + prefix_lens[j] - start[j]  # keys its last row sees
                local += n
                f = r * nseg + 2 * j + e
                per_block[1, f] = n
                per_block[2, f] = local
                per_block[3, f] = global_end - local  # global row - local index
                per_block[4, f] = kv - local  # position - local index
                per_block[5, f] = kv
                cu[r, 2 * j + e + 1] = local
                most_q = max(most_q, n)
                most_kv = max(most_kv, kv)
        buf[6 * blocks + r] = local
        buf[6 * blocks + cp_size + 2 * r] = most_q
        buf[6 * blocks + cp_size + 2 * r + 1] = most_kv
    return end


class ZigzagPlan(Plan):
    """Plan of the zigzag layout (see the module docstring).

    Computed at block granularity on flat rank-major arrays (see
    :class:`_BatchTables`) by one compiled kernel (:func:`_zigzag_blocks`): ``_q``
    block sizes = segment q_lens, ``_local_end`` each block's end in its owner's
    local order, and ``_shift`` [2, blocks]: per block, global row - local index and
    position - local index. A rank's plan is views of them: its segments are its
    blocks, and ``_shift`` their runs (:attr:`RankPlan.seg_shift`).
    """

    layout_name = "zigzag"

    def __init__(
        self,
        cp_size: int,
        extend_lens: np.ndarray,
        prefix_lens: np.ndarray,
        tables: _ZigzagTables | None = None,
        min_extend: int | None = None,
    ) -> None:
        num = extend_lens.shape[0]
        nseg = 2 * num
        tab = (tables if tables is not None else _ZigzagTables(cp_size)).batch(num)
        blocks = nseg * cp_size
        # one buffer: per block (rows 0-5, see the kernel), then per rank its local rows
        # and its segments' largest q_len and kv_len
        buf = np.empty(6 * blocks + 3 * cp_size, dtype=np.int64)
        cu = np.empty((cp_size, nseg + 1), dtype=np.int32)  # each rank's segment offsets
        num_tokens = _zigzag_blocks(extend_lens, prefix_lens, cp_size, buf, cu)
        buf.setflags(write=False)  # (before the views: they are exposed through RankPlans)
        cu.setflags(write=False)
        per_block = buf[: 6 * blocks].reshape(6, blocks)
        per_rank = buf[6 * blocks :].tolist()  # local rows [C], then (max q_len, max kv_len) [C, 2]
        local_rows = per_rank[:cp_size]
        super().__init__(cp_size, extend_lens, prefix_lens, num_tokens)
        d = self.__dict__
        d["_tab"] = tab
        d["_min_extend"] = min(extend_lens.tolist()) if min_extend is None else min_extend
        d["_sizes"] = per_block[0]  # global block order
        d["_q"] = per_block[1]  # rank-major from here
        d["_local_end"] = per_block[2]
        d["_shift"] = per_block[3:5]
        d["_kv"] = per_block[5]
        d["_cu"] = cu
        d["_per_rank"] = per_rank
        d["local_rows"] = local_rows
        d["max_local_rows"] = max(local_rows)

    def blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's blocks as ``(start, length)``, int64 [C, R, 2] each: rank ``r``'s
        early (``[..., 0]``) and late (``[..., 1]``) block of request ``j`` hold absolute
        positions ``start .. start + length``. Cheap (block granularity): a rank reads
        the others' holdings from it without building their plans."""
        shape = (self.cp_size, self.num_requests, 2)
        length = self._q.reshape(shape)
        return self._kv.reshape(shape) - length, length

    # ----------------------------------------------------------------- per rank

    def _build_rank(self, r: int) -> RankPlan:
        """Views of the plan's block arrays (each block one segment; its rows expand on
        first use)."""
        nseg = 2 * self.num_requests
        lo = r * nseg
        hi = lo + nseg
        return RankPlan(r, self._tab.seg_request, self._q[lo:hi], self._kv[lo:hi], self._cu[r], self._shift[:, lo:hi],
                        most=self._per_rank[self.cp_size + 2 * r : self.cp_size + 2 * r + 2])

    # ----------------------------------------------------------------- global maps

    def _gather_values(self, capacity: int) -> np.ndarray:
        """int64 [R * 2C], global block order: owner * capacity + local index - global row."""
        val = self._tab.owner_global * capacity
        val -= self._shift[0][self._tab.rm_of_global]
        return val

    @cached_property
    def owner(self) -> np.ndarray:  # type: ignore[override]
        out = self._tab.owner_global.repeat(self._sizes)
        freeze(out)
        return out

    @cached_property
    def local_index(self) -> np.ndarray:  # type: ignore[override]
        out = self._gather_values(0).repeat(self._sizes)
        out += arange(self.num_tokens)
        freeze(out)
        return out

    def gather_index(self, capacity: int) -> np.ndarray:
        cap = self._check_capacity(capacity)
        out = self._gather_values(cap).repeat(self._sizes)
        out += arange(self.num_tokens)
        return out

    def _last(self) -> tuple[np.ndarray, np.ndarray]:
        last = self.__dict__.get("_last_cache")
        if last is None:
            tab = self._tab
            c2 = 2 * self.cp_size
            if self._min_extend >= c2:
                # every last token is in block 2C-1: rank 0's late block of its request
                owner = tab.zeros
                local = self._local_end[1 : 2 * self.num_requests : 2] - 1
            else:
                m = np.minimum(self.extend_lens, c2)
                owner = tab.last_owner[m]
                f = tab.last_rm[m]
                f += tab.request_x2
                local = self._local_end[f]
                local -= 1
                owner.setflags(write=False)
            local.setflags(write=False)
            last = self.__dict__["_last_cache"] = (owner, local)
        return last

    @property
    def last_owner(self) -> np.ndarray:  # type: ignore[override]
        return self._last()[0]

    @property
    def last_local_index(self) -> np.ndarray:  # type: ignore[override]
        return self._last()[1]


class ZigzagLayout(Layout):
    """Zigzag CP layout: rank r owns blocks r and 2C-1-r of every request."""

    name = "zigzag"

    def __init__(self, cp_size: int) -> None:
        super().__init__(cp_size)
        self._tables = _ZigzagTables(self.cp_size)

    def _plan(self, extend_lens: np.ndarray, prefix_lens: np.ndarray, min_extend: int) -> ZigzagPlan:
        return ZigzagPlan(self.cp_size, extend_lens, prefix_lens, self._tables, min_extend)
