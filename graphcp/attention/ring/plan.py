"""Host-side plan of one forward's ring over a token-sharded KV cache.

Every rank derives the same facts from the batch's zigzag plan and the cache's
ledger (:mod:`graphcp.kv.placement.ledger`): which positions of each request every rank
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

A forward's plan (:func:`plan_sharded`) is compiled host kernels (:mod:`graphcp.jit`):
one pass sizes the buffers, one checks the history and writes every step's metadata,
the slots and the pass-KV message, O(C R) at block granularity plus the rank's rows.
The numpy counts (:func:`visible_keys`, from positions, and :func:`visible_keys_of` /
:func:`visible_keys_to`, from block indices) are the references the tests hold the
kernels to, and what words a refusal.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from graphcp.attention.base import AttentionMetadata, RankInputs
from graphcp.attention.ring.exchange_choice import ExchangeChoice, choose_exchange
from graphcp.attention.ring.hardware import HardwareSpec
from graphcp.attention.staging import to_device
from graphcp.cp.zigzag import ZigzagPlan
from graphcp.jit import host_kernel
from graphcp.kv.paged import PagedKVCache
from graphcp.kv.placement.ledger import page_count


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
            self._send_index = to_device(self.send_pages, device)
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
    history check still compares the sums with the blocks' positions. The forward's
    path counts the same in :func:`_ring_plan`; this words its refusals."""
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


def plan_sharded(plan: ZigzagPlan, kv: PagedKVCache, seq_ids: list[int], rank: int, exchange: str,
                 device: torch.device, choice: ExchangeChoice | None = None,
                 seq_rows: np.ndarray | None = None) -> ShardedInputs:
    """Rank ``rank``'s inputs for one batch over a sharded cache whose pages the batch
    has reserved (``kv.extend`` ran: the ledger counts this forward's blocks;
    ``seq_rows``: the sequences' table rows, when the caller has them). Two compiled
    passes (:func:`_ring_extent` sizes the buffers, :func:`_ring_plan` checks every
    row's history and writes them); the per-step Python is the metadata objects alone."""
    C, R, ps = plan.cp_size, plan.num_requests, kv.page_size
    start, length = plan.blocks()
    if seq_rows is None:
        seq_rows = kv.table_rows(seq_ids)
    ledger = kv.placement.ledger.counts  # (a token-sharded cache's: graphcp.kv.placement.sharded)
    pass_q = exchange == "pass-q"
    msg = np.empty(C, dtype=np.int64)
    shift = kv.allocator.table.page_shift
    own_width, widest = _ring_extent(ledger, seq_rows, rank, ps, shift, msg)
    if own_width > kv.table_width:  # (the kernel reads this rank's pages of every request from its table rows)
        raise RingPlanError(f"ring plan: the ledger gives rank {rank} {own_width} pages of one request, its page "
                            f"table holds {kv.table_width}; the cache's ledger and its pages disagree")
    S = 2 * R
    # pass-KV: a table as wide as the widest message's request (scratch past each); pass-Q: this rank's
    width = own_width if pass_q else widest
    buf0, cu0, kv0, seg_table = AttentionMetadata.host_buffers(S, own_width)
    packed = np.empty((C - 1, 2 * S + 1 + S * width), dtype=np.int32)  # steps 1 .. C-1, a row each
    slots = np.empty(plan.local_rows[rank], dtype=np.int64)
    send = np.empty(0 if pass_q else int(msg[rank]), dtype=np.int64)
    most = np.empty((C, 2), dtype=np.int64)
    seen = np.empty((2, R), dtype=np.int64)  # the history check's sums
    bad = _ring_plan(start, length, ledger, seq_rows, kv.table, rank, ps, shift, pass_q, seen, cu0, kv0, seg_table,
                     packed, width, slots, send, most)
    if bad >= 0:
        _refuse(rank, start, length, ledger[seq_rows].T)
    most = most.tolist()
    meta0 = AttentionMetadata._live(cu0, kv0, seg_table, ps, most[0][0], most[0][1], device, buf0)
    steps = [meta0, *_step_metadata(packed, S, width, most[1:], ps, device)]
    ring = RingPlan(exchange, C, rank, steps, list(plan.local_rows), [0] * C if pass_q else msg.tolist(), send, choice)
    return ShardedInputs(slots, meta0, seg_table, ring)


def _step_metadata(packed: np.ndarray, S: int, width: int, most: list[list[int]], page_size: int,
                   device) -> list[AttentionMetadata]:
    """Steps 1 .. C-1's (non-causal) metadata over their rows of ``packed`` (cu_seqlens_q,
    kv_lens, page table, as ``from_host`` packs one; ``most``: each step's largest q_len
    and kv_len)."""
    live = AttentionMetadata._live
    tables = packed[:, 2 * S + 1 :].reshape(-1, S, width)
    # each step's views from whole-buffer views (a row of each: cheaper than slicing every step's row three times)
    return [live(c, k, t, page_size, mq, mk, device, b, False)
            for b, c, k, t, (mq, mk) in zip(packed, packed[:, : S + 1], packed[:, S + 1 : 2 * S + 1], tables, most)]


def _refuse(rank: int, start: np.ndarray, length: np.ndarray, held_after: np.ndarray) -> None:
    """RingPlanError for a batch :func:`_ring_plan` refused, worded by the reference
    check (:func:`visible_keys_of`) from the ledger's counts (``held_after`` [C, R])."""
    held_before = held_after - length[..., 0]
    held_before -= length[..., 1]
    visible_keys_of(rank, start, length, held_before)  # raises when a block misses some of its history
    j = int(np.argmax(held_before[rank] < 0))  # else the ledger holds fewer positions than the blocks here
    raise RingPlanError(f"ring plan: the ledger gives rank {rank} {int(held_after[rank, j])} positions of request "
                        f"{j}, fewer than its blocks of this forward ({int(length[rank, j].sum())}); the cache's "
                        "ledger and the batch plan disagree")


@host_kernel
def _ring_extent(ledger, seq_rows, rank, page_size, page_shift, msg_pages):
    """Pages each rank holds of the batch's requests (request ``j``: ledger row
    ``seq_rows[j]``; :func:`page_count`), summed per rank into ``msg_pages`` [C]
    (pass-KV's messages). Returns the most pages one request has on rank ``rank`` and
    on any other rank (each at least 1: the page tables' widths)."""
    C = msg_pages.shape[0]
    own = other = 1
    for k in range(C):
        msg_pages[k] = 0
    for j in range(seq_rows.shape[0]):
        row = seq_rows[j]
        for k in range(C):
            pages = page_count(ledger[row, k], page_size, page_shift)
            msg_pages[k] += pages
            if k == rank:
                own = max(own, pages)
            else:
                other = max(other, pages)
    return own, other


@host_kernel
def _history(length, ledger, seq_rows, rank, seen):
    """Keys this rank's blocks see over all steps, per request ``j`` (``length`` [C, R,
    2]; its ledger row ``seq_rows[j]``): every cached position of every rank, and the
    early blocks of ranks k <= rank (its early block, into ``seen[0, j]``), or every
    early block and the late blocks of ranks k >= rank (its late block, ``seen[1, j]``).
    Rank by rank: each rank's blocks are a contiguous run of ``length``."""
    C, R = length.shape[0], length.shape[1]
    for j in range(R):
        seen[0, j] = seen[1, j] = 0
    for k in range(C):
        for j in range(R):
            early, late = length[k, j, 0], length[k, j, 1]
            cached = ledger[seq_rows[j], k] - early - late
            seen[0, j] += cached + early if k <= rank else cached
            seen[1, j] += cached + early + late if k >= rank else cached + early


@host_kernel
def _ring_plan(start, length, ledger, seq_rows, table, rank, page_size, page_shift, pass_q, seen, cu0, kv0, seg_table,
               packed, width, slots, send, most):
    """One rank's ring over a sharded cache (``start``/``length`` [C, R, 2]: the zigzag
    plan's blocks; request ``j``'s ledger row and this rank's table row are
    ``seq_rows[j]``; its segments ``2j`` early and ``2j + 1`` late). The history check
    first (:func:`_history`, into ``seen`` [2, R]): every live block of this rank sees
    its whole causal history over all steps (and the ledger holds this forward's blocks
    here); at the first that does not, returns ``2j + e`` (what was written is then not
    to be used). Request by request, writes step 0's metadata (``cu0`` [S + 1], ``kv0``
    [S], ``seg_table`` [S, w]: this rank's pages, scratch past the table), the new rows'
    slots (local indices after each request's cached pieces, early block first) into
    ``slots``, pass-KV (``pass_q`` False): this rank's pages of the requests, batch
    order, into ``send``; then :func:`_ring_steps` writes steps 1 .. C-1 into
    ``packed``; each step's largest q_len and kv_len into ``most`` [C, 2]. Returns -1."""
    R = length.shape[1]
    _history(length, ledger, seq_rows, rank, seen)
    for j in range(R):
        early, late = length[rank, j, 0], length[rank, j, 1]
        if (early and seen[0, j] != start[rank, j, 0] + early) or ledger[seq_rows[j], rank] < early + late:
            return 2 * j
        if late and seen[1, j] != start[rank, j, 1] + late:
            return 2 * j + 1
    cols = min(seg_table.shape[1], table.shape[1])
    most_q = most_kv = n = sent = 0
    cu0[0] = 0
    for j in range(R):
        row = seq_rows[j]
        early, late = length[rank, j, 0], length[rank, j, 1]
        hi = ledger[row, rank]
        lo = hi - early - late  # this rank's cached pieces of the request
        # step 0: its rows over its own keys (causal)
        cu0[2 * j + 1] = cu0[2 * j] + early
        cu0[2 * j + 2] = cu0[2 * j + 1] + late
        kv0[2 * j] = lo + early if early else 0
        kv0[2 * j + 1] = hi if late else 0
        most_q = max(most_q, early, late)
        most_kv = max(most_kv, kv0[2 * j], kv0[2 * j + 1])
        for c in range(cols):
            seg_table[2 * j, c] = seg_table[2 * j + 1, c] = table[row, c]
        for c in range(cols, seg_table.shape[1]):
            seg_table[2 * j, c] = seg_table[2 * j + 1, c] = 0
        # the new rows' slots: local index l in page table[row, l // page_size]
        while lo < hi:
            p = lo >> page_shift if page_shift >= 0 else lo // page_size
            stop = min((p + 1) * page_size, hi)
            shift = (int(table[row, p]) - p) * page_size  # slot - local index within page p (int64)
            for local in range(lo, stop):
                slots[n] = shift + local
                n += 1
            lo = stop
        if not pass_q:  # pass-KV's message: this rank's pages of the requests, batch order
            for p in range(page_count(hi, page_size, page_shift)):
                send[sent] = table[row, p]
                sent += 1
    most[0, 0], most[0, 1] = most_q, most_kv
    _ring_steps(length, ledger, seq_rows, rank, page_size, page_shift, pass_q, seg_table, packed, width, most)
    return -1


@host_kernel
def _ring_steps(length, ledger, seq_rows, rank, page_size, page_shift, pass_q, seg_table, packed, width, most):
    """Steps 1 .. C-1 of :func:`_ring_plan`: step i's row of ``packed`` [C - 1, 2S + 1 +
    S * width] (cu_seqlens_q, kv_lens, page table, as ``from_host`` packs one), source
    ``(rank - i) mod C``: pass-KV (``pass_q`` False) this rank's rows over the source's
    staged pages (its message's request j from page 1 + the pages of requests before,
    scratch past them), pass-Q the source's rows over this rank's pages (``seg_table``);
    its largest q_len and kv_len into ``most[i]``. A block of rank q sees, of rank k's
    keys of its request, every cached one, and (:func:`visible_keys_of`'s rule) the early
    block of k when k <= q (q's early block) or always (its late block), the late block
    of k when k >= q (its late block only); an empty block sees nothing."""
    C, R = length.shape[0], length.shape[1]
    S = 2 * R
    for i in range(1, C):
        src = rank - i if i <= rank else rank - i + C  # (rank - i) mod C
        q, k = (src, rank) if pass_q else (rank, src)  # the query rows' rank, the keys'
        below, above = k <= q, k >= q
        out = packed[i - 1]
        most_q = most_kv = cu = 0
        first = 1  # pass-KV: the source's pages of request j in its message, after the scratch page
        out[0] = 0
        for j in range(R):
            row = seq_rows[j]
            early, late = length[q, j, 0], length[q, j, 1]
            key_early, key_late = length[k, j, 0], length[k, j, 1]
            cached = ledger[row, k] - key_early - key_late
            seen_early = (cached + key_early if below else cached) if early else 0
            seen_late = (cached + key_early + key_late if above else cached + key_early) if late else 0
            cu += early
            out[2 * j + 1] = cu
            cu += late
            out[2 * j + 2] = cu
            out[S + 1 + 2 * j] = seen_early
            out[S + 2 + 2 * j] = seen_late
            most_q = max(most_q, max(early, late))
            most_kv = max(most_kv, max(seen_early, seen_late))
            at = 2 * S + 1 + 2 * j * width  # the request's two segments' rows of the page table
            if pass_q:
                for c in range(width):
                    out[at + c] = out[at + width + c] = seg_table[2 * j, c]
            else:
                pages = page_count(ledger[row, src], page_size, page_shift)
                for c in range(width):
                    out[at + c] = out[at + width + c] = first + c if c < pages else 0
                first += pages
        most[i, 0], most[i, 1] = most_q, most_kv


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
        return choose_exchange(self.exchange, plan.num_tokens, int(np.add.reduce(plan.prefix_lens)), self.num_heads,
                               self.num_kv_heads, self.head_dim, plan.cp_size, self.elem_bytes, self.hardware)

    def inputs(self, plan: ZigzagPlan, kv: PagedKVCache, seq_ids: list[int], rank: int,
               device: torch.device, seq_rows: np.ndarray | None = None) -> ShardedInputs:
        choice = self.choose(plan)
        return plan_sharded(plan, kv, seq_ids, rank, choice.exchange, device, choice, seq_rows)

    def rank_inputs(self, plan: ZigzagPlan, kv: PagedKVCache, seq_ids: list[int], rank: int, flat: np.ndarray,
                    device: torch.device, seq_rows: np.ndarray | None = None) -> RankInputs:
        """This rank's host inputs of a planned batch (the batch preparer's call): its own
        rows' ids, positions and local slots, step 0's metadata and the ring plan."""
        sh = self.inputs(plan, kv, seq_ids, rank, device, seq_rows)
        rp = plan.rank(rank)
        return RankInputs(flat[rp.rows], rp.positions, sh.slots, sh.meta, sh.seg_page_table, sh.ring)
