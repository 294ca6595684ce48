"""The placement contract: which rank holds which tokens and layers of a request.

A placement is a cache mode (``RuntimeConfig.kv_cache``). It reserves on this rank's
allocator the tokens that land here (all of them, or a token-sharded share), keeps
what every rank must know of the others (a sharded ledger), makes and checks the
handles (their ``holding`` is its own record), says where a decoded token lands, which
layers a rank keeps (:meth:`Placement.held_layers`; a storage lays its pools out by it)
and what it fetches before a layer's attention, and which spans of a request each rank
exports. It never touches a tensor but through the pools a storage hands it.

:class:`Placement` is the base every placement derives from; its answers are "every
rank holds every token of every layer" (the replicated mode's whole answer), and a
placement overrides where it says otherwise.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from graphcp.kv.allocator import PageAllocator, ones_of
from graphcp.kv.decode import EVERY_RANK, DecodeSlots
from graphcp.kv.handle import KVHandle, KVHandleError
from graphcp.kv.handle_check import HandleCheck
from graphcp.kv.layers import HeldLayers
from graphcp.kv.spans import KVSpan, whole_layer_spans
from graphcp.kv.spec import PoolSpec


class Placement:
    """Rank ``pool.rank`` of ``pool.cp_size``'s view of where a cache's tokens and
    layers (``pool.layers``, the ones it serves) are, over its ``allocator``."""

    #: the cache mode (RuntimeConfig.kv_cache) this placement is
    mode: ClassVar[str] = ""
    #: how a forward's layers store their K/V and attend (graphcp.attention.kv_exchange):
    #: ``all-gather`` writes every rank's rows here, ``ring`` keeps a rank's own
    exchange: ClassVar[str] = "all-gather"

    def __init__(self, allocator: PageAllocator, pool: PoolSpec) -> None:
        self.allocator, self.table = allocator, allocator.table
        self.rank, self.cp_size, self.layers = pool.rank, pool.cp_size, pool.layers
        self.checks = HandleCheck(allocator, self.request_tokens)

    # ---- sizing (the factory's, before a cache exists) ------------------------------
    @classmethod
    def held_layers(cls, pool: PoolSpec) -> HeldLayers:
        """The layers of ``pool.layers`` rank ``pool.rank`` keeps: every one here."""
        return HeldLayers(pool.layers, pool.layers, pool.cp_size)

    @classmethod
    def capture_bytes(cls, pool_bytes: int, num_layers: int, exchange: str) -> int:
        """What capturing the buckets reserves for this mode besides the pool: nothing."""
        return 0

    def rows_bound(self, cp_size: int) -> int:
        """The most rows one forward can give a rank: its share of a pool's worth of tokens."""
        return -(-self.allocator.num_pages * self.allocator.page_size // cp_size)

    # ---- tokens -------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.allocator.capacity_tokens

    @property
    def num_free_pages(self) -> int:
        """Free pages a batch planned the same way on every rank can count on."""
        return self.allocator.num_free_pages

    def request_tokens(self, rows: np.ndarray) -> np.ndarray:
        """int64: the positions of the live sequences in these table rows (what their
        handles' num_tokens say): here every one is stored on this rank."""
        return self.table.row_tokens[rows]

    def handle(self, seq_id: int, prev: KVHandle | None = None) -> KVHandle:
        """The sequence's handle now. ``prev``: its handle before a step that only extended
        it (its pages are reused: PageTable.pages_of_row)."""
        t = self.table
        row = t.live()[seq_id]
        return KVHandle(seq_id, int(t.row_tokens[row]), t.pages_of_row(row, () if prev is None else prev.pages),
                        self.allocator.cache_id)

    def reserve(self, prefixes: "list[KVHandle | None]", rows: np.ndarray | None,
                new: np.ndarray) -> tuple[list[int], np.ndarray]:
        """Reserve ``new[i]`` more tokens after ``prefixes[i]`` (``rows``: what
        :meth:`HandleCheck.prefix_rows` returned for them), all or nothing. Returns the
        sequence ids and their table rows."""
        return self.allocator.reserve(prefixes, rows, new)

    def rollback(self, seq_ids: list[int], new_tokens) -> None:
        """Undo a :meth:`reserve` (its forward failed)."""
        self.allocator.rollback(seq_ids, new_tokens)

    def release(self, handle: KVHandle) -> None:
        if not isinstance(handle, KVHandle) or handle.cache_id != self.allocator.cache_id:
            self.checks.check_handle(handle)  # raises, naming what is wrong
        if self.allocator.release(handle.seq_id) is None:
            raise KVHandleError(f"KV handle seq_id={handle.seq_id} is not live (already released?)")

    def snapshot(self) -> tuple:
        """The state a refused or undone call must leave as it was (tests compare it)."""
        return self.allocator.snapshot()

    # ---- a decode step (graphcp.kv.decode) ----------------------------------------
    def reserve_decode(self, handles: "list[KVHandle]", rows: np.ndarray) -> DecodeSlots:
        """Reserve one more token of each live request (``rows``: their prefix rows), all
        or nothing (KVCacheFull, nothing changed). Here every rank stores it, at its own
        position."""
        out = np.empty((4, len(handles)), dtype=np.int64)  # positions, holders, local lengths, slots
        positions, holder, local, slots = out
        ids = self.allocator.reserve_next(handles, rows, positions, slots)
        holder.fill(EVERY_RANK)
        np.add(positions, 1, out=local)
        return DecodeSlots(ids, self.allocator.last.rows, positions, holder, local, slots)

    def rollback_decode(self, step: DecodeSlots) -> None:
        """Undo :meth:`reserve_decode` (the step's forward failed): each request one token shorter."""
        self.rollback(step.seq_ids, ones_of(step.num_requests))

    def most_held(self, rows: np.ndarray) -> int:
        """The most tokens any rank holds of one of the live requests in table ``rows``
        (the same on every rank: a decode graph's page bucket)."""
        return int(self.request_tokens(rows).max())

    # ---- layers -------------------------------------------------------------------
    def stored_tokens_of(self, layer: int, batch_tokens: int, local_rows: int) -> int:
        """Tokens of a forward's batch (``batch_tokens`` in all, ``local_rows`` of them this
        rank's rows) whose ``layer`` this rank keeps: every one here."""
        return batch_tokens

    def attention_holder(self, layer: int) -> int | None:
        """The one rank that attends over every request's KV of ``layer`` in a decode step
        (the rank that keeps that layer), or None: each rank attends over what it holds."""
        return None

    def prefix_pages(self, prefixes: "list[KVHandle | None]") -> np.ndarray | None:
        """The cached-prefix pages a forward must fetch before each layer's attention
        (:meth:`fetch_prefix`); None: this rank keeps every layer, nothing to fetch."""
        return None

    def fetch_prefix(self, layer: int, pools: list[torch.Tensor], pages: torch.Tensor, group) -> int:
        """Before ``layer``'s attention, fetch the batch's cached-prefix ``pages`` of its
        per-page ``pools`` from the rank that keeps them; the bytes this rank received."""
        return 0

    # ---- export (graphcp.kv.spans.KVSource) ----------------------------------------
    def kv_spans(self, handle: KVHandle, cp_size: int) -> list[KVSpan]:
        """Every layer whole; the ranks export contiguous layer ranges (every rank holds all)."""
        return whole_layer_spans(len(self.layers), handle.num_tokens, cp_size, self.layers.start)

    def holds(self, span: KVSpan, rank: int) -> bool:
        return True

    def check_read(self, span: KVSpan) -> None:
        """ValueError unless this rank keeps ``span``'s layer."""

    def local_index(self, handle: KVHandle, position: int) -> int:
        """Where this rank stores the request's ``position`` (its local index): here every
        position at its own index."""
        return position
