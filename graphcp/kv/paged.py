"""A paged KV cache, composed of three parts (graphcp.kv.factory builds it):

- the **allocator** (graphcp.kv.allocator, graphcp.kv.page_table): this rank's pages,
  the free stack, the dense page table, a batch's reservation and rollback;
- the **placement** (graphcp.kv.placement): which rank holds which tokens and layers
  (the cache mode: replicated, token-sharded, layer-split), the handles and their
  checks, where a decoded token lands, the prefix fetch before a layer's attention, and
  the spans each rank exports;
- the **storage** (graphcp.kv.storage, or a family's own in its folder): what a token or
  a layer holds (K/V heads in a layout, a family's latents or entries, a recurrent
  layer's states), in pools of the layers this rank keeps.

:class:`PagedKVCache` is what the runtime, the attention exchange and the exports call.
Most of its surface is one part's operation, bound to the cache once (no delegation
frame on the per-forward host path); its own methods are the ones that need two parts:
a reservation that also takes a storage's per-request states, the prefix fetch of a
layer's pools, and an export's spans and reads, which a placement cuts and a storage fills.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import groupby
from operator import attrgetter
from typing import Callable

import numpy as np
import torch

from graphcp.kv.allocator import PageAllocator
from graphcp.kv.decode import DecodeSlots, stack_steps
from graphcp.kv.handle import KVHandle
from graphcp.kv.placement.base import Placement
from graphcp.kv.spans import KVSpan, whole_layer_spans
from graphcp.kv.storage.base import Storage

_layer_of = attrgetter("layer")


class PagedKVCache:
    """One rank's cache: ``allocator`` x ``placement`` x ``storage`` (module doc)."""

    # ---- the parts' operations, bound in __init__ (see each part for its doc) ------
    # the allocator's table: rows, page tables, slots
    table_rows: Callable[[list[int]], np.ndarray]
    page_table: Callable[..., np.ndarray]
    page_table_rows: Callable[..., np.ndarray]
    slots: Callable[..., np.ndarray]
    run_slots: Callable[..., np.ndarray]
    pages_for: Callable[[int], int]
    stored_tokens: Callable[[], int]
    stored_pages: Callable[[], int]
    # the placement: handles, decode steps, what a rank keeps of a forward
    check_handle: Callable[[KVHandle], None]
    prefix_rows: Callable[[list], "np.ndarray | None"]
    handle: Callable[[int], KVHandle]
    release: Callable[[KVHandle], None]
    snapshot: Callable[[], tuple]
    most_held: Callable[[np.ndarray], int]
    rows_bound: Callable[[int], int]
    stored_tokens_of: Callable[[int, int, int], int]
    prefix_pages: Callable[[list], "np.ndarray | None"]
    attention_holder: Callable[[int], "int | None"]
    local_index: Callable[[KVHandle, int], int]
    # the storage: a layer's pools, the write of exchanged rows, what a token holds
    layer: Callable[[int], torch.Tensor]
    write: Callable[[int, torch.Tensor, torch.Tensor], None]
    page_pools: Callable[[], "dict[str, torch.Tensor]"]
    state_pools: Callable[[], "dict[str, torch.Tensor]"]
    token_values: Callable[[int], int]

    def __init__(self, allocator: PageAllocator, placement: Placement, storage: Storage) -> None:
        self.allocator, self.placement, self.storage = allocator, placement, storage
        #: the cache mode (RuntimeConfig.kv_cache), and the exchange its layers store and attend through
        self.mode, self.exchange = placement.mode, storage.exchange(placement.exchange)
        self.cache_id, self.num_pages, self.page_size = allocator.cache_id, allocator.num_pages, allocator.page_size
        #: the global layers the cache serves (a pipeline stage's, and a draft's after them)
        self.layers = placement.layers
        #: this rank in its CP group
        self.rank, self.cp_size = placement.rank, placement.cp_size
        self.layout = storage.layout
        self.capacity_tokens: int = placement.capacity_tokens
        t = allocator.table
        self.table_rows, self.page_table, self.page_table_rows = t.rows_of, t.page_table, t.page_table_rows
        self.slots, self.run_slots = t.slots, t.run_slots
        self.pages_for, self.stored_tokens, self.stored_pages = (allocator.pages_for, allocator.stored_tokens,
                                                                 allocator.stored_pages)
        p = placement
        self.check_handle, self.prefix_rows = p.checks.check_handle, p.checks.prefix_rows
        self.handle, self.release, self.snapshot = p.handle, p.release, p.snapshot
        self.most_held = p.most_held
        self.rows_bound, self.stored_tokens_of, self.prefix_pages = p.rows_bound, p.stored_tokens_of, p.prefix_pages
        self.attention_holder, self.local_index = p.attention_holder, p.local_index
        s = storage
        self.layer, self.write, self.token_values = s.layer, s.write, s.token_values
        self.page_pools, self.state_pools = s.page_pools, s.state_pools
        self._placed_reserve, self._states = p.reserve, s.states

    # ---- reservation --------------------------------------------------------------
    def extend(self, prefixes: "list[KVHandle | None]", new_tokens) -> list[int]:
        """Reserve room for ``new_tokens[i]`` more tokens after ``prefixes[i]`` (a new
        sequence when None), all or nothing. Returns the sequence ids."""
        if len(prefixes) != len(new_tokens):
            raise ValueError("prefixes and new_tokens must have the same length")
        return self.reserve(prefixes, self.prefix_rows(prefixes), np.asarray(new_tokens, dtype=np.int64))[0]

    def reserve(self, prefixes: "list[KVHandle | None]", rows: np.ndarray | None,
                new: np.ndarray) -> tuple[list[int], np.ndarray]:
        """:meth:`extend` for a caller that has the prefixes' rows already (the batch
        preparer's hot path): ``rows`` is what :meth:`prefix_rows` returned for
        ``prefixes``, nothing changed since, ``new`` int64 [R]. Returns the sequence ids
        and their table rows (:meth:`table_rows`); a storage's per-request states are
        taken too (refused, and the pages given back, when their slots are full)."""
        ids, taken = self._placed_reserve(prefixes, rows, new)
        states = self._states
        if states is not None:
            refused = states.admit(taken)
            if refused is not None:
                self.placement.rollback(ids, new)
                raise refused
        return ids, taken

    def rollback(self, seq_ids: list[int], new_tokens=None) -> None:
        """Undo a reservation (a forward that failed after reserving): the pages, and a
        storage's states, exactly as they were before it. ``new_tokens``: what it
        reserved of each request (a placement that records it, the sharded one, needs none)."""
        states = self._states
        if states is None:
            self.placement.rollback(seq_ids, new_tokens)
            return
        rows = self.table_rows(seq_ids)
        self.placement.rollback(seq_ids, new_tokens)
        states.undo(rows)

    def reserve_decode(self, handles: "list[KVHandle]", rows: np.ndarray) -> DecodeSlots:
        """One more token of each live request (``rows``: their prefix rows), where the
        placement puts it (graphcp.kv.decode), all or nothing; a storage's per-request
        states taken as a prefill's reservation takes them (the step's ``states``)."""
        step = self.placement.reserve_decode(handles, rows)
        states = self._states
        if states is None:
            return step
        refused = states.admit(step.rows)
        if refused is not None:
            self.placement.rollback_decode(step)
            raise refused
        return replace(step, states=states.step_slots(step.rows))

    def reserve_rows(self, handles: "list[KVHandle]", rows: np.ndarray, n: int) -> DecodeSlots:
        """``n`` more tokens of each live request (a verify step's rows), one
        :meth:`reserve_decode` after the other, so each lands where the placement puts a
        decoded token; all or nothing. Its rows are request-major (graphcp.kv.decode.stack_steps)."""
        if n == 1:
            return self.reserve_decode(handles, rows)
        if self._states is not None:  # (a linear-attention hybrid: refused with a draft, combinations.py)
            raise ValueError("a step of several rows a request needs a cache without per-request states")
        steps: list[DecodeSlots] = []
        try:
            for _ in range(n):
                steps.append(self.placement.reserve_decode(handles, rows))
        except BaseException:
            for s in reversed(steps):
                self.placement.rollback_decode(s)
            raise
        return stack_steps(steps)

    def rollback_decode(self, step: DecodeSlots) -> None:
        """Undo :meth:`reserve_decode` or :meth:`reserve_rows` (the step's forward failed):
        each request as many tokens shorter as it reserved, its states the ones it read."""
        if step.steps:
            for s in reversed(step.steps):
                self.placement.rollback_decode(s)
            return
        self.placement.rollback_decode(step)
        if self._states is not None:
            self._states.undo(step.rows)

    def trim_decode(self, step: DecodeSlots, keep: np.ndarray) -> None:
        """After a verify step (:meth:`reserve_rows`): request j keeps its first ``keep[j]``
        rows (>= 1) and gives the rest back, last first, on every rank alike (the token-sharded
        cache's ledger too), as a rollback of those rows would."""
        keep = np.asarray(keep, dtype=np.int64)
        for i in range(len(step.steps) - 1, 0, -1):
            gone = keep <= i
            if gone.any():
                s = step.steps[i]
                self.placement.rollback_decode(s if gone.all() else s.subset(gone))

    @property
    def num_free_pages(self) -> int:
        return self.placement.num_free_pages

    @property
    def table(self) -> np.ndarray:
        """The dense ``[rows, table_width]`` int32 page table, as a read-only view (do not
        hold it across a reservation: the table is reallocated when it grows)."""
        return self.allocator.table.view

    @property
    def table_width(self) -> int:
        """Most pages one sequence may hold (the dense table's columns)."""
        return self.allocator.table.width

    # ---- the storage's tensors ----------------------------------------------------
    @property
    def pool(self) -> torch.Tensor:
        """The storage's first page pool."""
        return self.storage.pool

    @property
    def pool_bytes(self) -> int:
        """Bytes of this rank's pools (every page pool, scratch page included, and every state pool)."""
        pools = (*self.page_pools().values(), *self.state_pools().values())
        return sum(t.numel() * t.element_size() for t in pools)

    def fetch_prefix(self, layer: int, pages: torch.Tensor | None, group) -> int:
        """Before ``layer``'s attention, fetch the batch's cached-prefix ``pages`` of it
        (:meth:`prefix_pages`, on the pools' device; None: nothing to fetch) from where
        they are kept; the bytes this rank received."""
        if pages is None:
            return 0
        return self.placement.fetch_prefix(layer, self.storage.layer_pools(layer), pages, group)

    # ---- export (graphcp.kv.spans.KVSource) ----------------------------------------
    def kv_spans(self, handle: KVHandle, cp_size: int) -> list[KVSpan]:
        """The spans covering every (layer, position) of the request once, in layer then
        position order: the placement's; a layer of per-request state whole."""
        spans = self.placement.kv_spans(handle, cp_size)
        state = self.storage.state_layers
        if not state:
            return spans
        by_layer = {layer: list(group) for layer, group in groupby(spans, _layer_of)}
        out = []
        for whole in whole_layer_spans(len(self.layers), handle.num_tokens, cp_size, self.layers.start):
            out += [whole] if whole.layer in state else by_layer[whole.layer]
        return out

    def holds(self, span: KVSpan, rank: int) -> bool:
        """Whether ``rank`` can read ``span`` locally (a layer of per-request state: whether it keeps the layer)."""
        if span.layer in self.storage.state_layers:
            owner = self.storage.held.owner(span.layer)
            return owner is None or owner == rank
        return self.placement.holds(span, rank)

    def read_span(self, handle: KVHandle, span: KVSpan) -> tuple[torch.Tensor, ...]:
        """On a rank that holds it, ``span`` of the request in the export format's tensors
        (new tensors; the cache is not changed). A span's positions are consecutive local
        indices here (a span never crosses what another rank holds)."""
        self.check_handle(handle)
        self.placement.check_read(span)
        if span.layer in self.storage.state_layers:
            return self.storage.read_state(int(self.table_rows([handle.seq_id])[0]), span.layer)
        start = self.local_index(handle, span.start)
        return self.storage.read_span(handle.pages, span.layer, start, start + span.num_tokens)

    # ---- import (PrefillEngine.import_kv: the export's reads, inverted) --------------
    def write_import(self, handle: KVHandle, layer: int, values: tuple[torch.Tensor, ...]) -> None:
        """Store an imported request's ``layer`` (one this rank keeps: ``storage.held``):
        ``values`` are the export format's tensors of the positions this rank holds
        (``handle.positions(rank)``, in local order), or of a per-request state layer
        whole; the request was just reserved (``handle`` is live)."""
        row = int(self.table_rows([handle.seq_id])[0])
        if layer in self.storage.state_layers:
            self.storage.write_state(row, layer, values)
            return
        n = handle.local_tokens(self.rank)
        slots = self.run_slots(np.array([row], dtype=np.int64), np.arange(n, dtype=np.int64),
                               np.array([n], dtype=np.int64))
        self.storage.write_span(layer, values, torch.from_numpy(slots).to(self.pool.device))
