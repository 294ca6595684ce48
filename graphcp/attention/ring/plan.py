"""Host-side plan of one forward's ring over a token-sharded KV cache.

Every rank derives the same facts from the batch's zigzag plan and the cache's
ledger (:mod:`graphcp.kv.sharded`): which positions of each request every rank
holds (its cached prefix pieces, then this forward's early and late blocks). The
masks then follow from positions alone. A query block ``(q, j, e)`` (rank ``q``'s
early or late block of request ``j``) sees, of rank ``k``'s keys of request ``j``,

    held_before[k, j] + |k's early block below its end| + |k's late block below its end|

(positions are increasing in every rank's local order, so the visible keys are a
prefix of rank ``k``'s keys of the request: one ``kv_len`` per segment). With
``k = q`` that is bottom-right causal (step 0); a block of another rank lies wholly
before or after a query block, so the count is the same for all its rows: a
non-causal segment (steps 1 .. C-1), whose ``kv_len`` is 0 where the block sees
nothing. Summed over ``k`` the counts must give every query row its whole causal
history (``position + 1`` keys): checked for every block of every rank before any
kernel runs, so a row that no step touches is a planning error, never a silent
NaN or 0.

Pass-KV: at step ``i`` rank ``r`` attends its own rows to the KV of rank
``(r - i) mod C``, which arrives as that rank's pages of the batch's requests, in
batch order, in a staging buffer (page 0 is scratch). Pass-Q: at step ``i`` rank
``r`` attends the rows of rank ``(r - i) mod C`` to its own pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from graphcp.attention.base import AttentionMetadata, max_of
from graphcp.attention.ring.exchange_choice import ExchangeChoice, choose_exchange
from graphcp.attention.ring.hardware import HardwareSpec
from graphcp.cp.base import arange
from graphcp.cp.zigzag import ZigzagPlan
from graphcp.kv.sharded import ShardedKVCache


class RingPlanError(RuntimeError):
    """The ring's per-step metadata does not give some query row its causal history
    (a bug in the plan or the cache's ledger, caught before any kernel runs)."""


@dataclass
class RingPlan:
    """One forward's ring on one rank (host side; the device metadata uploads on use)."""

    exchange: str  # "pass-kv" | "pass-q"
    cp_size: int
    rank: int
    #: step i's metadata: step 0 (causal) is this rank's rows over its own keys; step
    #: i >= 1 is pass-KV: its rows over rank (r - i)'s staged KV, pass-Q: rank (r - i)'s
    #: rows over its own keys. Empty for an inert (capture) plan.
    steps: list[AttentionMetadata]
    rows: list[int]  # live query rows of every rank
    msg_pages: list[int]  # pass-KV: pages of every rank's KV message (0s for pass-Q)
    send_pages: np.ndarray  # pass-KV: this rank's pages of the batch's requests, batch order
    choice: ExchangeChoice | None = None
    _send_index: torch.Tensor | None = None

    @classmethod
    def inert(cls, cp_size: int, rank: int) -> "RingPlan":
        """The plan of a batch without rows (graph capture): every step is skipped."""
        zeros = [0] * cp_size
        return cls("pass-kv", cp_size, rank, [], zeros, zeros, np.zeros(0, dtype=np.int64))

    @property
    def live(self) -> bool:
        return any(self.rows)

    def send_index(self, device: torch.device) -> torch.Tensor:
        """:attr:`send_pages` on the device (uploaded once per forward)."""
        if self._send_index is None:
            self._send_index = torch.from_numpy(self.send_pages).to(device)
        return self._send_index


@dataclass
class ShardedInputs:
    """What one rank computes for its own rows: the cache slots of its new rows (local
    indices of its pool), its step-0 metadata and page table, and the ring plan."""

    slots: np.ndarray
    meta: AttentionMetadata
    seg_page_table: np.ndarray
    ring: RingPlan


def _seen(end_q: np.ndarray, start: np.ndarray, length: np.ndarray, held: np.ndarray) -> np.ndarray:
    """Keys of a key rank that query blocks ending at ``end_q`` see (shapes broadcast;
    the last axis of ``start``/``length`` is the key rank's early and late block)."""
    vis = np.minimum(np.maximum(end_q - start[..., :1], 0), length[..., :1])
    vis += np.minimum(np.maximum(end_q - start[..., 1:], 0), length[..., 1:])
    vis += held[..., None]
    return vis


def _check_history(total: np.ndarray, end: np.ndarray, live: np.ndarray, ranks: np.ndarray) -> None:
    """RingPlanError unless every live query block (ranks[q]'s, [Q, R, 2]) sees exactly
    its causal history, ``end`` keys, over all steps (``total``)."""
    if not np.array_equal(total[live], end[live]):
        q, j, e = (int(x[0]) for x in np.nonzero(live & (total != end)))
        raise RingPlanError(
            f"ring plan: rank {int(ranks[q])}'s {'late' if e else 'early'} block of request {j} ends at position "
            f"{int(end[q, j, e]) - 1} but the ring's steps show it {int(total[q, j, e])} keys (expected "
            f"{int(end[q, j, e])}); the cache's ledger and the batch plan disagree"
        )


def visible_keys(start: np.ndarray, length: np.ndarray, held_before: np.ndarray) -> np.ndarray:
    """int64 [C (queries), C (keys), R, 2]: keys of rank k a query block (q, j, e) sees,
    from positions (module doc); 0 for empty query blocks. Raises RingPlanError unless
    every query row gets its whole causal history. (Every rank's: O(C^2 R); a rank's
    forward needs only its own row and column, :func:`visible_keys_of`.)"""
    end = start + length  # one past each block's last position
    vis = _seen(end[:, None], start[None], length[None], held_before[None])
    empty = (length == 0)[:, None]
    vis = np.where(empty, 0, vis)
    _check_history(vis.sum(axis=1), end, ~empty[:, 0], np.arange(start.shape[0]))
    return vis


def visible_keys_of(rank: int, start: np.ndarray, length: np.ndarray, held_before: np.ndarray) -> np.ndarray:
    """``visible_keys(...)[rank]``, int64 [C, R, 2]: what this rank's query blocks see of
    every rank's keys, O(C R). Raises RingPlanError unless this rank's rows get their
    whole causal history (every rank checks its own).

    ``start``/``length`` are a zigzag plan's blocks (:meth:`ZigzagPlan.blocks`), so the
    counts need no positions: a request's blocks are consecutive in position order,
    block ``k`` on rank ``k`` (early) and ``2C-1-k`` on rank ``k`` (late), so a key
    block is wholly visible to a query block when its index is not above the query
    block's, else not at all. This rank's early block (index r) sees the early blocks of
    ranks k <= r; its late block (2C-1-r) every early block and the late blocks of ranks
    k >= r; both see every cached position. A few numpy calls over [C, R] (the general
    count from positions is :func:`visible_keys`, which the tests hold this to); the
    history check still compares the sums with the blocks' positions."""
    # counted early / late outermost ([2, C, R], contiguous: every operation runs its
    # inner loop over the requests; over [C, R, 2] or its strided [C, R] halves it runs C R
    # loops of 2, or strides through memory, several times the cost an element)
    by_block = np.ascontiguousarray(length.transpose(2, 0, 1))  # [2, C, R]
    early, late = by_block[0], by_block[1]  # (unpacking iterates: slower)
    seen = early + held_before  # every rank's early block and cached positions
    vis = np.empty((2, *early.shape), dtype=np.int64)
    vis[0, : rank + 1] = seen[: rank + 1]  # the early block sees the early blocks of ranks k <= r
    vis[0, rank + 1 :] = held_before[rank + 1 :]
    vis[1, :rank] = seen[:rank]  # the late block every early block, and the late blocks of ranks k >= r
    np.add(seen[rank:], late[rank:], out=vis[1, rank:])
    live = by_block[:, rank] > 0  # [2, R]
    if not live.all():
        vis *= live[:, None]  # an empty query block sees nothing
    total = np.add.reduce(vis, axis=1)  # [2, R]
    end = (start[rank] + length[rank]).T  # [2, R]
    if not np.array_equal(total, end * live):  # (every live block's whole history; the error worded as everywhere)
        _check_history(total.T[None], end.T[None], live.T[None], np.array([rank]))
    return vis.transpose(1, 2, 0)  # [C, R, 2]


@lru_cache(maxsize=1024)
def _rank_masks(cp_size: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 [C, 1] each: 1 for the ranks k <= rank, and for the ranks k >= rank."""
    k = np.arange(cp_size, dtype=np.int64)[:, None]
    below, above = (k <= rank).astype(np.int64), (k >= rank).astype(np.int64)
    below.setflags(write=False)
    above.setflags(write=False)
    return below, above


def visible_keys_to(rank: int, start: np.ndarray, length: np.ndarray, held_before: np.ndarray) -> np.ndarray:
    """``visible_keys(...)[:, rank]``, int64 [C, R, 2]: what every rank's query blocks see
    of this rank's keys (what pass-Q attends here), O(C R). From block indices, as
    :func:`visible_keys_of` counts (``start``/``length``: a zigzag plan's blocks): rank
    q's early block (index q) sees this rank's early block when q >= rank; its late
    block (2C-1-q) sees this rank's early block always and its late block when q <= rank."""
    below, above = _rank_masks(start.shape[0], rank)  # [C, 1] over q: q <= rank, q >= rank
    early, late, held = length[rank, :, 0], length[rank, :, 1], held_before[rank]  # [R]
    col = np.empty(length.shape, dtype=np.int64)
    np.multiply(above, early, out=col[..., 0])
    col[..., 0] += held
    np.multiply(below, late, out=col[..., 1])
    col[..., 1] += early + held
    col *= length > 0  # an empty query block sees nothing
    return col


def _cu(q_lens: np.ndarray) -> np.ndarray:
    cu = np.zeros(q_lens.size + 1, dtype=np.int64)
    np.add.accumulate(q_lens, out=cu[1:])  # (np.cumsum: the same, through more Python)
    return cu


@lru_cache(maxsize=1024)
def _sources(cp_size: int, rank: int) -> np.ndarray:
    """int64 [C - 1]: the rank whose keys (pass-KV) or rows (pass-Q) step i >= 1 reads, (r - i) mod C."""
    out = (rank - np.arange(1, cp_size)) % cp_size
    out.setflags(write=False)
    return out


def _ring_steps(exchange: str, rank: int, cu: np.ndarray, row: np.ndarray, col: np.ndarray | None,
                length: np.ndarray, pages: np.ndarray, seg_request: np.ndarray, seg_table: np.ndarray, page_size: int,
                device) -> list[AttentionMetadata]:
    """Steps 1 .. C-1's metadata, built for all steps at once into one packed int32
    buffer (a row a step: cu_seqlens_q, kv_lens, page table, as ``from_host`` packs
    one); the per-step Python is the metadata object alone. Pass-KV: this rank's rows
    over rank (r - i)'s staged pages (a table as wide as the widest message's
    request, scratch past each); pass-Q: rank (r - i)'s rows over this rank's pages."""
    C = row.shape[0]
    if C == 1:
        return []
    srcs = _sources(C, rank)
    n = C - 1
    S = seg_request.shape[0]
    if exchange == "pass-kv":
        src_pages = pages[srcs]  # [n, R]
        width = max(int(src_pages.max(initial=0)), 1)
        first = 1 + np.add.accumulate(src_pages, axis=1) - src_pages  # after the scratch page
        column = np.arange(width)
        tables = np.where(column < src_pages[..., None], first[..., None] + column, 0)  # [n, R, width]
        kv_lens = row[srcs].reshape(n, S)
        cus, q_lens = cu, length[rank].reshape(1, S)  # every step: this rank's rows
    else:
        width = seg_table.shape[1]
        tables = None  # every step: this rank's pages (seg_table)
        kv_lens = col[srcs].reshape(n, S)
        q_lens = length[srcs].reshape(n, S)
        cus = np.zeros((n, S + 1), dtype=np.int64)
        np.add.accumulate(q_lens, axis=1, out=cus[:, 1:])
    buf = np.empty((n, 2 * S + 1 + S * width), dtype=np.int32)
    buf[:, : S + 1] = cus
    buf[:, S + 1 : 2 * S + 1] = kv_lens
    step_tables = buf[:, 2 * S + 1 :].reshape(n, S, width)
    if tables is None:
        step_tables[:] = seg_table
    else:  # each segment's request's row, gathered straight into the buffer
        np.take(tables, seg_request, axis=1, out=step_tables)
    max_q = np.maximum.reduce(q_lens, axis=1).tolist() * (n // q_lens.shape[0]) if S else [0] * n
    max_kv = np.maximum.reduce(kv_lens, axis=1).tolist() if S else [0] * n
    live = AttentionMetadata._live
    # each step's views from whole-buffer views (a row of each: cheaper than slicing every step's row three times)
    return [live(c, k, t, page_size, mq, mk, device, b, False)
            for b, c, k, t, mq, mk in zip(buf, buf[:, : S + 1], buf[:, S + 1 : 2 * S + 1], step_tables, max_q, max_kv)]


def plan_sharded(plan: ZigzagPlan, kv: ShardedKVCache, seq_ids: list[int], rank: int, exchange: str,
                 device: torch.device, choice: ExchangeChoice | None = None,
                 seq_rows: np.ndarray | None = None) -> ShardedInputs:
    """Rank ``rank``'s inputs for one batch over a sharded cache whose pages the batch
    has reserved (``kv.extend`` ran: the ledger counts this forward's blocks;
    ``seq_rows``: the sequences' table rows, when the caller has them)."""
    C, R, ps = plan.cp_size, plan.num_requests, kv.page_size
    start, length = plan.blocks()
    if seq_rows is None:
        seq_rows = kv.table_rows(seq_ids)
    held_after = kv.rank_tokens(seq_ids, seq_rows)  # [C, R]
    held_before = held_after - length[..., 0]
    held_before -= length[..., 1]
    row = visible_keys_of(rank, start, length, held_before)
    col = visible_keys_to(rank, start, length, held_before) if exchange == "pass-q" else None
    pages = -(-held_after // ps)  # [C, R]: each rank's pages of each request
    seg_request = plan.rank(rank).seg_request  # (the rank's plan is built and cached by now)
    q_lens = length[rank].reshape(-1)
    cu = _cu(q_lens)
    # this rank's own keys of the batch's requests, all of them (pass-Q and step 0 read them)
    width = max(int(pages[rank].max(initial=0)), 1)
    own_table = kv.page_table_rows(seq_rows, width)
    # step 0's metadata written in place into its packed buffer (as from_host packs it)
    buf, cu0, kv0, seg_table = AttentionMetadata.host_buffers(2 * R, width)
    cu0[:] = cu
    kv_own = row[rank].reshape(-1)
    kv0[:] = kv_own
    own_table.take(seg_request, axis=0, out=seg_table)
    meta0 = AttentionMetadata._live(cu0, kv0, seg_table, ps, max_of(q_lens), max_of(kv_own), device, buf)
    # local index of each new row: after the request's cached pieces, early block first
    # (a request's two blocks are consecutive rows here: one run per request)
    req_rows = length[rank, :, 0] + length[rank, :, 1]
    local = np.repeat(held_before[rank] - cu[:-1:2], req_rows)
    local += arange(local.shape[0])
    slots = kv.run_slots(seq_rows, local, req_rows)
    steps = [meta0, *_ring_steps(exchange, rank, cu, row, col, length, pages, seg_request, seg_table, ps, device)]
    msg_pages = [0] * C
    send_pages = np.zeros(0, dtype=np.int64)
    if exchange == "pass-kv":
        msg_pages = pages.sum(axis=1).tolist()
        mask = np.arange(width) < pages[rank][:, None]
        send_pages = own_table[mask].astype(np.int64)
    ring = RingPlan(exchange, C, rank, steps, np.add.reduce(length.reshape(C, -1), axis=1).tolist(), msg_pages,
                    send_pages, choice)
    return ShardedInputs(slots, meta0, seg_table, ring)


@dataclass(frozen=True)
class RingPlanner:
    """What a rank needs to plan every forward's ring: the exchange asked for (or
    "auto") and what the per-batch choice reads (the model's heads, the element
    size, the hardware)."""

    exchange: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    elem_bytes: int
    hardware: HardwareSpec

    def choose(self, plan: ZigzagPlan) -> ExchangeChoice:
        return choose_exchange(self.exchange, plan.num_tokens, int(plan.prefix_lens.sum()), self.num_heads,
                               self.num_kv_heads, self.head_dim, plan.cp_size, self.elem_bytes, self.hardware)

    def inputs(self, plan: ZigzagPlan, kv: ShardedKVCache, seq_ids: list[int], rank: int,
               device: torch.device, seq_rows: np.ndarray | None = None) -> ShardedInputs:
        choice = self.choose(plan)
        return plan_sharded(plan, kv, seq_ids, rank, choice.exchange, device, choice, seq_rows)
