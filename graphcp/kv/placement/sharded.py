"""The token-sharded cache mode: each CP rank stores only its own zigzag blocks.

For every forward (every chunk of a chunked prefill) rank ``r`` stores the KV of its
early block ``r`` and late block ``2C-1-r`` of each request's new tokens, and nothing
else, so a request's cached prefix is spread over the ranks and a rank's pool holds
about ``1/C`` of every request. Within a rank a request's positions are stored in
increasing order (local index 0, 1, ...: its blocks of the first chunk, then of the
next, ...), in that rank's own pages: the allocator's sequences count the positions
stored here, and ``reserve``, ``rollback``, ``release`` and the handles speak in whole
requests, as for a replicated cache.

Every rank keeps the same ledger (graphcp.kv.placement.ledger) of what every rank
holds, so admission refuses a batch the same way on all of them (``KVCacheFull``
naming the rank, its free pages and what the batch needs). A handle carries its
request's ledger entry (:class:`ShardedHolding`): every rank derives every other
rank's positions from it alone. ``RuntimeConfig.kv_tokens`` is one rank's pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from operator import add, itemgetter, not_

import numpy as np

from graphcp.cp.zigzag import ZigzagLayout, rank_token_counts
from graphcp.kv.allocator import PageAllocator
from graphcp.kv.decode import DecodeSlots, add_decoded, decode_owner, decoded_positions, drop_decoded
from graphcp.kv.handle import KVHandle
from graphcp.kv.placement.base import Placement
from graphcp.kv.placement.ledger import Chunks, Ledger
from graphcp.kv.spans import KVSpan, position_spans
from graphcp.kv.spec import PoolSpec


@dataclass(frozen=True)
class ShardedHolding:
    """A request's ledger entry, as its handle carries it: ``chunks`` the ``(cached,
    new)`` tokens of every forward that wrote it, in order (the zigzag layout of each
    says which of its positions each rank holds); ``rank_tokens`` how many positions
    each rank holds (sums to its tokens); ``decoded`` the positions decode steps added, as
    runs ``(first, count, tokens on each rank before)`` (graphcp.kv.decode)."""

    cp_size: int
    chunks: Chunks
    rank_tokens: tuple[int, ...]
    decoded: tuple[tuple[int, int, tuple[int, ...]], ...] = ()

    def local_tokens(self, num_tokens: int, rank: int) -> int:
        return self.rank_tokens[rank]

    def positions(self, num_tokens: int, rank: int) -> np.ndarray:
        layout = ZigzagLayout(self.cp_size)
        out = []
        for cached, new in self.chunks:
            start, length = layout.plan([new], [cached]).blocks()
            for s, n in zip(start[rank, 0].tolist(), length[rank, 0].tolist()):
                out.append(np.arange(s, s + n, dtype=np.int64))
        if self.decoded:  # decoded tokens lie between the chunks: local order is position order
            out.append(decoded_positions(self.decoded, rank))
            return np.sort(np.concatenate(out))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


class ShardedPlacement(Placement):
    mode = "sharded"
    exchange = "ring"

    def __init__(self, allocator: PageAllocator, pool: PoolSpec) -> None:
        if not 0 <= pool.rank < pool.cp_size:
            raise ValueError(f"rank must be in [0, {pool.cp_size}), got {pool.rank}")
        super().__init__(allocator, pool)
        self.ledger = Ledger(allocator, pool.cp_size)

    @classmethod
    def capture_bytes(cls, pool_bytes: int, num_layers: int, exchange: str) -> int:
        """pass-KV's two staging buffers, reserved at capture: two layers of the pool."""
        return 0 if exchange == "pass-q" else 2 * pool_bytes // max(num_layers, 1)

    def rows_bound(self, cp_size: int) -> int:
        """A rank's pool holds only its own tokens: a forward can give it a pool's worth."""
        return self.allocator.num_pages * self.allocator.page_size

    def stored_tokens_of(self, layer: int, batch_tokens: int, local_rows: int) -> int:
        """A rank keeps its own rows' K/V."""
        return local_rows

    # ---- capacity ---------------------------------------------------------------
    @property
    def rank_capacity_tokens(self) -> int:
        """Tokens one rank's pool holds (what ``kv_tokens`` sized)."""
        return self.allocator.capacity_tokens

    @property
    def capacity_tokens(self) -> int:
        """Tokens the C pools hold together: a request longer than this fits no
        sharding (a reservation checks each rank's pool exactly)."""
        return self.cp_size * self.allocator.capacity_tokens

    @property
    def num_free_pages(self) -> int:
        """The fewest free pages of any rank: what a batch planned the same way on every
        rank can count on (each rank's: :meth:`Ledger.free_pages`)."""
        return int(self.allocator.num_pages - 1 - self.ledger.used.max())

    def request_tokens(self, rows: np.ndarray) -> np.ndarray:
        return self.ledger.held[rows].sum(axis=1)

    def rank_tokens(self, seq_ids: list[int], rows: np.ndarray | None = None) -> np.ndarray:
        """int64 [C, len(seq_ids)]: positions each rank holds of these live sequences
        (``rows``: their table rows, when the caller has them)."""
        return np.ascontiguousarray(self.ledger.held[self.table.rows_of(seq_ids) if rows is None else rows].T)

    def rank_used_pages(self) -> np.ndarray:
        """int64 [C]: pages every rank's pool has handed out (the ledger's count)."""
        return self.ledger.used.copy()

    def most_held(self, rows: np.ndarray) -> int:
        """The most tokens any rank holds of one of these requests (every rank's ledger says)."""
        return int(self.ledger.held[rows].max())

    # ---- reservation -------------------------------------------------------------
    def reserve(self, prefixes: "list[KVHandle | None]", rows: np.ndarray | None,
                new: np.ndarray) -> tuple[list[int], np.ndarray]:
        """Reserve, on every rank, each request's share of ``new[i]`` more tokens after
        ``prefixes[i]``; all or nothing, and the same outcome on every rank. The counts
        and the room check are one compiled pass (:meth:`Ledger.room`)."""
        num, C = new.shape[0], self.cp_size
        held = np.empty((num, C), dtype=np.int64)  # each request's tokens on each rank before (0: new)
        after = np.empty((num, C), dtype=np.int64)  # and after, as the ledger's rows hold them
        mine = np.empty(num, dtype=np.int64)  # this rank's new tokens of each request
        cached = np.empty(num, dtype=np.int64)  # each request's tokens before, all ranks
        need = np.empty(C, dtype=np.int64)  # the pages the batch takes on every rank
        all_new = rows is None  # every request new: nothing held, no chunk before
        L = self.ledger
        if not L.room(rows, new, self.rank, held, after, mine, cached, need):
            L.check_room(None if all_new else held, after)  # raises, worded as the room check words it
            raise RuntimeError("the compiled room check refused a batch the reference admits (a bug)")
        ids, rows = self.allocator.reserve(prefixes, rows, mine)
        L.set_rows(rows, after)
        # each request's chunks gain (cached, new): zip(zip(a, b)) yields ((a_i, b_i),)
        chunks = L.chunks()  # (the previous reservation's deferred chunks, written now)
        last = self.allocator.last
        if all_new:  # every request new: its one chunk (0, new) waits for the first read
            held = before = None
            L.pending = (last.ids, new.copy() if new.flags.writeable else new)
        else:
            before = list(map(chunks.get, ids, repeat(())))
            chunks.update(zip(ids, map(add, before, zip(zip(cached.tolist(), new.tolist())))))
        L.used += need
        # what the undo of this reservation writes back (valid while it is the last one)
        L.undo_record = (last, held, need, before, None)
        return ids, rows

    def rollback(self, seq_ids: list[int], new_tokens=None) -> None:
        """Undo a :meth:`reserve`: each request's last chunk (the ledger's, so
        ``new_tokens`` is not needed) comes off every rank's share at once."""
        L, a = self.ledger, self.allocator
        last = L.undoes(seq_ids)
        if last is not None:
            L.undo_last(seq_ids, last)
            a.undo_last()
            return
        rows = self.table.rows_of(seq_ids)
        chunks = list(map(L.chunks().__getitem__, seq_ids))
        new = np.fromiter(map(itemgetter(1), map(itemgetter(-1), chunks)), np.int64, len(chunks))
        counts = rank_token_counts(self.cp_size, new)  # [C, R]
        after = L.held[rows].T
        before = after - counts
        L.used -= a.pages(after).sum(axis=1) - a.pages(before).sum(axis=1)
        L.held[rows] = before.T
        rest = list(map(itemgetter(slice(None, -1)), chunks))
        L.chunks().update(zip(seq_ids, rest))
        dropped = np.fromiter(map(not_, rest), bool, len(rest))  # no chunk left: the reservation created it
        for i in np.flatnonzero(dropped).tolist():
            del L.chunks()[seq_ids[i]]
        last = a.last
        if last is not None and last.undoes(seq_ids):  # the last reservation, nothing changed since
            a.undo_last()
        else:
            a.undo(seq_ids, rows, self.table.row_tokens[rows] - counts[self.rank], dropped)

    def release(self, handle: KVHandle) -> None:
        row = self.table.live().get(handle.seq_id) if isinstance(handle, KVHandle) else None
        super().release(handle)  # checks the handle, frees this rank's pages
        self.ledger.release(row, handle.seq_id)

    def handle(self, seq_id: int, prev: KVHandle | None = None) -> KVHandle:
        t, L = self.table, self.ledger
        row = t.live()[seq_id]
        held = L.held[row].tolist()
        return KVHandle(seq_id, sum(held), t.pages_of_row(row, () if prev is None else prev.pages),
                        self.allocator.cache_id,
                        ShardedHolding(self.cp_size, L.chunks()[seq_id], tuple(held), L.decoded.get(seq_id, ())))

    def snapshot(self) -> tuple:
        return self.allocator.snapshot() + self.ledger.snapshot(self.table.live())

    # ---- a decode step ------------------------------------------------------------
    def reserve_decode(self, handles: "list[KVHandle]", rows: np.ndarray) -> DecodeSlots:
        """One more token of each request on one rank (the one holding fewest of it,
        round-robin among equals: graphcp.kv.decode), on every rank's ledger alike; all
        or nothing (KVCacheFull naming the rank that is short, on every rank)."""
        L = self.ledger
        B = len(handles)
        held = L.held[rows]  # [B, C] before (a copy)
        positions = held.sum(axis=1)
        holder = decode_owner(held, positions)
        after = held.copy()
        after[np.arange(B), holder] += 1
        need = L.check_room(held, after)
        mine = (holder == self.rank).astype(np.int64)
        local = held[:, self.rank]
        ids, taken = self.allocator.reserve(handles, rows, mine)
        L.set_rows(taken, after)
        chunks = L.chunks()
        decoded = L.decoded
        before = list(map(decoded.get, ids, repeat(())))
        decoded.update(zip(ids, map(add_decoded, before, positions.tolist(), map(tuple, held.tolist()))))
        L.used += need
        L.undo_record = (self.allocator.last, held, need, list(map(chunks.__getitem__, ids)), before)
        slots = np.full(B, -1, dtype=np.int64)  # -1: another rank stores it (the write lands in scratch)
        here = mine > 0
        if here.any():
            slots[here] = self.table.run_slots(taken[here], local[here], mine[here])
        return DecodeSlots(ids, taken, positions, holder, local + mine, slots)

    def rollback_decode(self, step: DecodeSlots) -> None:
        """Undo :meth:`reserve_decode`: every rank's ledger and this rank's pages as they were."""
        L, a = self.ledger, self.allocator
        last = L.undoes(step.seq_ids)
        if last is not None:
            L.undo_last(step.seq_ids, last)
            a.undo_last()
            return
        rows = self.table.rows_of(step.seq_ids)  # something changed since: undo request by request
        after = L.held[rows]
        before = after.copy()
        before[np.arange(len(rows)), step.holder] -= 1
        L.used -= np.add.reduce(a.pages(after) - a.pages(before), axis=0)
        L.set_rows(rows, before)
        for s in step.seq_ids:
            L.decoded[s] = drop_decoded(L.decoded[s])
            if not L.decoded[s]:
                del L.decoded[s]
        mine = (step.holder == self.rank).astype(np.int64)
        a.undo(step.seq_ids, rows, self.table.row_tokens[rows] - mine, np.zeros(len(rows), dtype=bool))

    # ---- export (graphcp.kv.spans.KVSource) --------------------------------------
    def kv_spans(self, handle: KVHandle, cp_size: int) -> list[KVSpan]:
        """Per layer, one span per run of consecutive positions a rank stores (its zigzag
        blocks of every forward that wrote the request, adjacent blocks merged), owned by
        that rank, in position order: each rank exports what it holds, nothing else."""
        held = [handle.positions(r) for r in range(cp_size)]
        return position_spans(len(self.layers), held, self.layers.start)

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
