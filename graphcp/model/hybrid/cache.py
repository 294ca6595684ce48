"""A hybrid's cache: the full-attention layers' paged K/V, as a dense model's in each
cache mode, beside each live request's linear-attention state (docs/hybrid.md).

Per linear layer and live request the state is the recurrence's ``[Hv, d_k, d_v]``
(float32) and the convolution's last ``K`` pre-convolution rows ``[K, conv_dim]`` (the
model dtype; transformers' ``conv_states`` transposed). A request's states live in two
*slots* of its page-table row ``r`` (``2 r`` and ``2 r + 1``): a forward reads the one
holding the prefix's state and writes the other, and its reservation flips which one is
current (a rollback flips it back). So re-running a prepared batch (a capture's
self-check) reads the same states, and a failed forward leaves every prefix's state
as it was (but for a request split over pipeline micro-batches, whose pieces read and
write its two slots in turn: a failure after both ran leaves the later piece's state).
The rows a cache hands out stay below ``RuntimeConfig.state_slots`` (a batch that would
need more live requests is refused, as a full pool is).

- replicated (:class:`HybridKVCache`): every rank keeps every layer's states;
- sharded (:class:`ShardedHybridCache`): the K/V token-sharded, the states on every
  rank (O(1) in a request's length; every rank composes them anyway, docs/hybrid.md);
- layer-split (:class:`LayerSplitHybridCache`): rank r keeps the K/V of its own full
  layers (and one scratch layer) and the states of its own linear layers; before a
  linear layer runs, its owner broadcasts the batch's prefix states.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphcp.dist import CPGroup
from graphcp.kv.layer_split import LayerSplitKVCache
from graphcp.kv.paged import KVCacheFull, KVHandle, PagedKVCache
from graphcp.kv.sharded import ShardedKVCache
from graphcp.kv.spans import KVSpan, owned_layers, position_spans, whole_layer_spans
from graphcp.kv.spec import KVHeads, PoolSpec
from graphcp.model.hybrid.config import FULL, LINEAR


@dataclass(frozen=True)
class LinearDims:
    """One rank's linear-attention heads (its attention-TP share) and convolution."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    def state_bytes(self, itemsize: int) -> int:
        """One slot of one layer: the float32 recurrent state and the conv rows."""
        return 4 * self.num_v_heads * self.k_head_dim * self.v_head_dim + itemsize * self.conv_kernel * self.conv_dim


@dataclass(frozen=True)
class HybridGeometry:
    """What a hybrid's cache sizes by: the full layers' K/V heads, every layer's kind,
    this rank's linear heads and the live requests whose states it keeps."""

    kv: KVHeads
    layer_kinds: tuple[str, ...]
    linear: LinearDims
    state_slots: int

    def of_kind(self, layers, kind: str) -> list[int]:
        return [i for i in layers if self.layer_kinds[i] == kind]


def _kv_bytes(geometry: HybridGeometry, pool: PoolSpec, layers: int) -> int:
    itemsize = torch.empty(0, dtype=pool.dtype).element_size()
    kv = geometry.kv
    return layers * pool.num_pages * 2 * pool.page_size * kv.num_kv_heads * kv.head_dim * itemsize


def _state_bytes(geometry: HybridGeometry, pool: PoolSpec, layers: int) -> int:
    itemsize = torch.empty(0, dtype=pool.dtype).element_size()
    return layers * 2 * geometry.state_slots * geometry.linear.state_bytes(itemsize)


class LinearStates:
    """The states every hybrid cache keeps (mixed in ahead of its K/V cache class): two
    slots a live request's row, per held linear layer; the row bound, the slot flips."""

    @classmethod
    def create(cls, geometry: HybridGeometry, pool: PoolSpec) -> "LinearStates":
        """Every hybrid mode builds from the geometry and the pool alone (the cache factory's call)."""
        return cls(geometry, pool)

    def _init_states(self, geometry: HybridGeometry, pool: PoolSpec, held: list[int]) -> None:
        """``held``: the linear layers whose states this rank keeps."""
        d, S = geometry.linear, geometry.state_slots
        self.geometry, self.state_slots, self.stage_layers = geometry, S, pool.layers
        self.linear_index = {layer: j for j, layer in enumerate(held)}
        self._phase = np.zeros(S, dtype=np.int64)  # per row: which of its two slots a forward writes next
        self.recurrent = torch.zeros(len(held), 2 * S, d.num_v_heads, d.k_head_dim, d.v_head_dim,
                                     dtype=torch.float32, device=pool.device)
        self.conv = torch.zeros(len(held), 2 * S, d.conv_kernel, d.conv_dim, dtype=pool.dtype, device=pool.device)

    def holds_state(self, layer: int) -> bool:
        return layer in self.linear_index

    def state_pools(self) -> dict[str, torch.Tensor]:
        """The per-request states (slots along dim 1), besides the page pools."""
        return {"linear_recurrent": self.recurrent, "linear_conv": self.conv}

    @property
    def pool_bytes(self) -> int:
        return super().pool_bytes + sum(t.numel() * t.element_size() for t in self.state_pools().values())

    def reserve(self, prefixes, rows, new) -> tuple[list[int], np.ndarray]:
        """The K/V reservation, refused (unchanged) when a request would take a row past
        the state slots; then each request's current slot flips (module doc)."""
        ids, taken = super().reserve(prefixes, rows, new)
        if taken.shape[0] and int(taken.max()) >= self.state_slots:
            super().rollback(ids, new)
            raise KVCacheFull(f"linear-attention state slots full: the batch needs {int(taken.max()) + 1} live "
                              f"requests' states, the cache keeps {self.state_slots}", "state_slots")
        self._phase[taken] ^= 1
        return ids, taken

    def rollback(self, seq_ids: list[int], new_tokens) -> None:
        rows = self.table_rows(seq_ids)
        super().rollback(seq_ids, new_tokens)
        self._phase[rows] ^= 1

    def state_slots_of(self, rows: np.ndarray, prefixed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int64 ``(read, write)`` slots of the reserved requests in table ``rows``: the
        prefix's state (-1: none, a zero state) and where this forward writes."""
        rows = np.asarray(rows, dtype=np.int64)
        write = 2 * rows + self._phase[rows]
        read = np.where(prefixed, 2 * rows + 1 - self._phase[rows], -1)
        return read, write

    def committed_slot(self, row: int) -> int:
        """The slot holding the state of the sequence in ``row`` (what its last forward
        wrote: what an export reads)."""
        return 2 * row + int(self._phase[row])

    def read_states(self, layer: int, read: torch.Tensor, group: CPGroup,
                    prefixed: bool = True) -> tuple[tuple[torch.Tensor, ...], int]:
        """``(recurrent [R, Hv, d_k, d_v], conv [R, K, conv_dim])`` of the prefixes in
        ``read`` (-1: zeros; ``prefixed``: whether any is given, known on the host), and
        the bytes received fetching them (0 here)."""
        j = self.linear_index[layer]
        return _gather((self.recurrent[j], self.conv[j]), read), 0

    def write_states(self, layer: int, write: torch.Tensor, recurrent: torch.Tensor, conv: torch.Tensor) -> None:
        j = self.linear_index[layer]
        self.recurrent[j].index_copy_(0, write, recurrent)
        self.conv[j].index_copy_(0, write, conv.to(self.conv.dtype))

    # ---- export (graphcp.kv.spans.KVSource; graphcp.model.hybrid.export) ------------------
    def kv_spans(self, handle: KVHandle, cp_size: int) -> list[KVSpan]:
        """Every layer whole (a full layer's positions as the mode holds them, :meth:`full_spans`),
        the ranks exporting contiguous layer ranges."""
        layers = self.stage_layers
        out = []
        for span in whole_layer_spans(len(layers), handle.num_tokens, cp_size, layers.start):
            full = self.geometry.layer_kinds[span.layer] == FULL
            out += self.full_spans(handle, span, cp_size) if full else [span]
        return out

    def full_spans(self, handle: KVHandle, whole: KVSpan, cp_size: int) -> list[KVSpan]:
        """A full layer's spans (here the whole layer, every rank holding it)."""
        return [whole]

    def holds(self, span: KVSpan, rank: int) -> bool:
        if self.geometry.layer_kinds[span.layer] == FULL:
            return super().holds(span, rank)
        return self.holds_states(span.layer, rank)

    def holds_states(self, layer: int, rank: int) -> bool:
        """Whether ``rank`` keeps ``layer``'s states (every rank, but under the layer split)."""
        return True

    def read_span(self, handle: KVHandle, span: KVSpan):
        """A full layer's K and V (the mode's), or a linear layer's ``conv`` ``[conv_dim, K]``
        and float32 ``recurrent`` ``[Hv, d_k, d_v]`` (new tensors; the committed slot)."""
        if self.geometry.layer_kinds[span.layer] == FULL:
            return super().read_span(handle, span)
        self.check_handle(handle)
        slot = self.committed_slot(int(self.table_rows([handle.seq_id])[0]))
        j = self.linear_index[span.layer]
        return self.conv[j, slot].t().contiguous(), self.recurrent[j, slot].clone()


def _gather(pools: tuple[torch.Tensor, ...], slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each pool's rows at ``slots``, zero where the slot is -1."""
    given = slots >= 0
    safe = slots.clamp(min=0)
    out = []
    for p in pools:
        rows = p.index_select(0, safe)
        out.append(torch.where(given.view(-1, *([1] * (p.dim() - 1))), rows, torch.zeros_like(rows)))
    return tuple(out)


class FullLayers:
    """A K/V pool holding only the full-attention layers: a global layer's pool index."""

    def _full(self, full: list[int]) -> None:
        self.full_index = {layer: j for j, layer in enumerate(full)}
        self.full_layers = tuple(full)

    def local_layer(self, i: int) -> int:
        j = self.full_index.get(i)
        if j is None:
            raise IndexError(f"layer {i} has no K/V here: this cache holds the full-attention layers "
                             f"{list(self.full_layers)}")
        return j


class HybridKVCache(LinearStates, FullLayers, PagedKVCache):
    """The replicated mode (module doc)."""

    exchange = "hybrid+all-gather"

    @classmethod
    def pool_bytes_for(cls, geometry: HybridGeometry, pool: PoolSpec) -> int:
        return (_kv_bytes(geometry, pool, len(geometry.of_kind(pool.layers, FULL)))
                + _state_bytes(geometry, pool, len(geometry.of_kind(pool.layers, LINEAR))))

    def __init__(self, geometry: HybridGeometry, pool: PoolSpec) -> None:
        full = geometry.of_kind(pool.layers, FULL)
        self._full(full)
        kv = geometry.kv
        PagedKVCache.__init__(self, len(full), pool.num_pages, pool.page_size, kv.num_kv_heads, kv.head_dim,
                              pool.dtype, pool.device, kv.layout, pool.max_pages_per_seq, pool.layers.start)
        self._init_states(geometry, pool, geometry.of_kind(pool.layers, LINEAR))


class ShardedHybridCache(LinearStates, FullLayers, ShardedKVCache):
    """The token-sharded mode: the K/V of a rank's own zigzag blocks, every state (module doc)."""

    exchange = "hybrid+ring"

    @classmethod
    def pool_bytes_for(cls, geometry: HybridGeometry, pool: PoolSpec) -> int:
        return HybridKVCache.pool_bytes_for(geometry, pool)

    def __init__(self, geometry: HybridGeometry, pool: PoolSpec) -> None:
        full = geometry.of_kind(pool.layers, FULL)
        self._full(full)
        kv = geometry.kv
        ShardedKVCache.__init__(self, len(full), pool.num_pages, pool.page_size, kv.num_kv_heads, kv.head_dim,
                                pool.dtype, pool.device, kv.layout, max_pages_per_seq=pool.max_pages_per_seq,
                                first_layer=pool.layers.start, cp_size=pool.cp_size, rank=pool.rank)
        self._init_states(geometry, pool, geometry.of_kind(pool.layers, LINEAR))

    def full_spans(self, handle: KVHandle, whole: KVSpan, cp_size: int) -> list[KVSpan]:
        """A full layer's runs of positions, each exported by the rank that stored it."""
        held = [handle.positions(r) for r in range(cp_size)]
        return position_spans(1, held, whole.layer)


def _owned(pool: PoolSpec) -> range:
    own = owned_layers(pool.rank, len(pool.layers), pool.cp_size)
    return range(pool.layers.start + own.start, pool.layers.start + own.stop)


class LayerSplitHybridCache(LinearStates, LayerSplitKVCache):
    """The layer-split mode (module doc): the K/V pool holds the rank's own full layers
    and one scratch layer, the states its own linear layers."""

    exchange = "hybrid+all-gather"

    @classmethod
    def pool_bytes_for(cls, geometry: HybridGeometry, pool: PoolSpec) -> int:
        owned = _owned(pool)
        return (_kv_bytes(geometry, pool, len(geometry.of_kind(owned, FULL)) + 1)
                + _state_bytes(geometry, pool, len(geometry.of_kind(owned, LINEAR))))

    def __init__(self, geometry: HybridGeometry, pool: PoolSpec) -> None:
        self._split(len(pool.layers), pool.rank, pool.cp_size, pool.layers.start)
        self.owned_full = geometry.of_kind(self.owned, FULL)
        self.full_layers = tuple(geometry.of_kind(pool.layers, FULL))
        kv = geometry.kv
        PagedKVCache.__init__(self, len(self.owned_full) + 1, pool.num_pages, pool.page_size, kv.num_kv_heads,
                              kv.head_dim, pool.dtype, pool.device, kv.layout, pool.max_pages_per_seq,
                              pool.layers.start)
        self.num_layers = len(pool.layers)  # the split's
        self.scratch_layer = self.pool.shape[0] - 1
        self._init_states(geometry, pool, geometry.of_kind(self.owned, LINEAR))

    def layer(self, i: int) -> torch.Tensor:
        """A full layer's K/V when this rank owns it, else the shared scratch layer."""
        if self.geometry.layer_kinds[i] != FULL:
            raise IndexError(f"layer {i} is a linear-attention layer: it has no K/V")
        return self.pool[self.pool_index(i, self.owned_full)]

    def read_states(self, layer: int, read: torch.Tensor, group: CPGroup,
                    prefixed: bool = True) -> tuple[tuple[torch.Tensor, ...], int]:
        """The prefixes' states: the layer's owner reads them and broadcasts them (one
        message each) when some request extends a prefix; every rank calls it."""
        d = self.geometry.linear
        R = read.shape[0]
        shapes = ((R, d.num_v_heads, d.k_head_dim, d.v_head_dim), (R, d.conv_kernel, d.conv_dim))
        if not prefixed:  # the same on every rank: a batch without prefixes
            return tuple(torch.zeros(s, dtype=t, device=read.device)
                         for s, t in zip(shapes, (torch.float32, self.conv.dtype))), 0
        src = self.owner(layer)
        if group.rank == src:
            rec, conv = super().read_states(layer, read, group, prefixed)[0]
            group.broadcast_(rec, src)
            group.broadcast_(conv, src)
            return (rec, conv), 0
        rec = torch.empty(shapes[0], dtype=torch.float32, device=read.device)
        conv = torch.empty(shapes[1], dtype=self.conv.dtype, device=read.device)
        group.broadcast_(rec, src)
        group.broadcast_(conv, src)
        return (rec, conv), rec.nbytes + conv.nbytes

    def write_states(self, layer: int, write: torch.Tensor, recurrent: torch.Tensor, conv: torch.Tensor) -> None:
        if layer in self.linear_index:  # its owner keeps it; every rank computed it
            super().write_states(layer, write, recurrent, conv)

    def holds_states(self, layer: int, rank: int) -> bool:
        return rank == self.owner(layer)
