"""A hybrid's cache storage: the full-attention layers' paged K/V, as a dense model's,
beside each live request's linear-attention state (docs/hybrid.md), in any cache mode.

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

The K/V of the full layers are placed as the mode places a dense model's (token-sharded
included); the states are O(1) in a request's length and every rank composes them anyway
(docs/hybrid.md), so every rank keeps every layer's states, but under the layer split,
where rank r keeps the states of its own linear layers and, before a linear layer runs,
its owner broadcasts the batch's prefix states.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphcp.dist import CPGroup
from graphcp.kv.handle import KVCacheFull
from graphcp.kv.layers import HeldLayers
from graphcp.kv.spec import CacheGeometry, KVHeads, PoolSpec
from graphcp.kv.storage.base import Storage, itemsize
from graphcp.kv.storage.kv_heads import KVHeadsStorage
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
class HybridGeometry(CacheGeometry):
    """What a hybrid's cache sizes by: the full layers' K/V heads, every layer's kind,
    this rank's linear heads and the live requests whose states it keeps."""

    kv: KVHeads
    layer_kinds: tuple[str, ...]
    linear: LinearDims
    state_slots: int
    #: rows of per-row states a verify step keeps (an EAGLE-3 draft's: the largest decode
    #: bucket; 0 without a draft), after the live requests' slots (:class:`LinearStates`)
    verify_rows: int = 0

    def kind(self, layer: int) -> str:
        """A layer's kind; a layer after the model's (an EAGLE-3 draft's) keeps K/V."""
        return self.layer_kinds[layer] if layer < len(self.layer_kinds) else FULL

    def of_kind(self, layers, kind: str) -> list[int]:
        return [i for i in layers if self.kind(i) == kind]


class LinearStates:
    """Every held linear layer's states, two slots a live request's row (module doc): the
    slots a forward reads and writes, and the flips a reservation and a rollback make
    (graphcp.kv.storage.base.RequestStates)."""

    def __init__(self, geometry: HybridGeometry, pool: PoolSpec, held: HeldLayers) -> None:
        d, S = geometry.linear, geometry.state_slots
        self.dims, self.state_slots, self.held = d, S, held
        kept = [i for i in geometry.of_kind(held.served, LINEAR) if i in held.held]
        self.linear_index = {layer: j for j, layer in enumerate(kept)}
        self._phase = np.zeros(S, dtype=np.int64)  # per row: which of its two slots a forward writes next
        #: a verify step's per-row states: slots ``2S ..`` of the pools (static: a decode graph
        #: writes them), or for an eager step of more rows, :attr:`_spill`
        self.verify_base, self.verify_rows = 2 * S, geometry.verify_rows
        self._spill: tuple[torch.Tensor, torch.Tensor] | None = None
        slots = 2 * S + self.verify_rows
        self.recurrent = torch.zeros(len(kept), slots, d.num_v_heads, d.k_head_dim, d.v_head_dim,
                                     dtype=torch.float32, device=pool.device)
        self.conv = torch.zeros(len(kept), slots, d.conv_kernel, d.conv_dim, dtype=pool.dtype, device=pool.device)

    def pools(self) -> dict[str, torch.Tensor]:
        """The per-request states (slots along dim 1), besides the page pools."""
        return {"linear_recurrent": self.recurrent, "linear_conv": self.conv}

    def admit(self, rows: np.ndarray) -> KVCacheFull | None:
        """Refused (nothing changed) when a request would take a row past the state slots;
        else each request's current slot flips (module doc)."""
        if rows.shape[0] and int(rows.max()) >= self.state_slots:
            return KVCacheFull(f"linear-attention state slots full: the batch needs {int(rows.max()) + 1} live "
                               f"requests' states, the cache keeps {self.state_slots}", "state_slots")
        self._phase[rows] ^= 1
        return None

    def undo(self, rows: np.ndarray) -> None:
        self._phase[rows] ^= 1

    def slots_of(self, rows: np.ndarray, prefixed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int64 ``(read, write)`` slots of the reserved requests in table ``rows``: the
        prefix's state (-1: none, a zero state) and where this forward writes."""
        rows = np.asarray(rows, dtype=np.int64)
        write = 2 * rows + self._phase[rows]
        read = np.where(prefixed, 2 * rows + 1 - self._phase[rows], -1)
        return read, write

    def step_slots(self, rows: np.ndarray) -> np.ndarray:
        """int64 ``[2, B]``: a decode step's (read, write) slots of the requests in table
        ``rows`` (after :meth:`admit`; every one extends its prefix)."""
        read, write = self.slots_of(rows, np.ones(len(rows), dtype=bool))
        return np.stack([read, write])

    def row_pools(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a step of several rows a request writes each row's states of ``layer``
        (``rows``: the step's, padding included): ``(recurrent [rows, ...], conv [rows, K,
        conv_dim])``, the verify slots (a decode graph's rows, at most the largest bucket)
        or, for an eager step of more rows, a spill buffer; None without verify slots (a
        cache built without a draft keeps every row of such a step: nothing to select)."""
        j = self.linear_index.get(layer)
        if j is None or not self.verify_rows:
            return None
        if rows <= self.verify_rows:
            b = self.verify_base
            return self.recurrent[j, b: b + rows], self.conv[j, b: b + rows]
        if self._spill is None or self._spill[0].shape[1] != rows:
            self._spill = (self.recurrent.new_zeros(self.recurrent.shape[0], rows, *self.recurrent.shape[2:]),
                           self.conv.new_zeros(self.conv.shape[0], rows, *self.conv.shape[2:]))
        return self._spill[0][j], self._spill[1][j]

    def keep_rows(self, step, keep: np.ndarray) -> None:
        """After a verify step (``step``: its graphcp.kv.decode.DecodeSlots, ``n`` rows a
        request): request j's state becomes the one after its row ``keep[j] - 1`` (the step
        wrote the last row's to its write slot, and every row's to :meth:`row_pools`); its
        read slot, the state before the step, is untouched."""
        n = step.rows_per_request
        keep = np.asarray(keep, dtype=np.int64)
        short = np.flatnonzero(keep < n)
        if not short.size or not self.linear_index:
            return
        if not self.verify_rows:
            raise ValueError("a verify step's rejected rows: this cache keeps no per-row states (built without a "
                             "draft)")
        R = len(step.seq_ids)
        src = short * n + keep[short] - 1  # the step's row of each request's last kept token
        dst = torch.from_numpy(step.states[1, short * n]).to(self.recurrent.device)
        if R <= self.verify_rows:
            at = torch.from_numpy(src + self.verify_base).to(self.recurrent.device)
            rec, conv = self.recurrent.index_select(1, at), self.conv.index_select(1, at)
        else:
            at = torch.from_numpy(src).to(self.recurrent.device)
            rec, conv = self._spill[0].index_select(1, at), self._spill[1].index_select(1, at)
        self.recurrent.index_copy_(1, dst, rec)
        self.conv.index_copy_(1, dst, conv)

    def written_slots(self, step) -> np.ndarray:
        """The slots a decode step writes (its write slots; a verify step's rows' too):
        what a decode graph's self-check compares."""
        out = np.unique(step.states[1])
        if step.steps and self.verify_rows and len(step.seq_ids) <= self.verify_rows:
            out = np.concatenate([out, self.verify_base + np.arange(len(step.seq_ids))])
        return out

    def layer_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A held linear layer's ``(recurrent [2S + V, Hv, d_k, d_v], conv [2S + V, K, conv_dim])``
        pools (V: the verify slots; None: this rank does not keep it)."""
        j = self.linear_index.get(layer)
        return None if j is None else (self.recurrent[j], self.conv[j])

    def committed_slot(self, row: int) -> int:
        """The slot holding the state of the sequence in ``row`` (what its last forward
        wrote: what an export reads)."""
        return 2 * row + int(self._phase[row])

    def read_states(self, layer: int, read: torch.Tensor, group: CPGroup,
                    prefixed: bool = True) -> tuple[tuple[torch.Tensor, ...], int]:
        """``(recurrent [R, Hv, d_k, d_v], conv [R, K, conv_dim])`` of the prefixes in
        ``read`` (-1: zeros; ``prefixed``: whether any is given, known on the host), and
        the bytes received fetching them. Every rank calls it: a layer one rank keeps
        (the layer split) its owner reads and broadcasts (one message each) when some
        request extends a prefix."""
        src = self.held.owner(layer)
        if src is None:  # every rank keeps it
            j = self.linear_index[layer]
            return _gather((self.recurrent[j], self.conv[j]), read), 0
        d = self.dims
        R = read.shape[0]
        shapes = ((R, d.num_v_heads, d.k_head_dim, d.v_head_dim), (R, d.conv_kernel, d.conv_dim))
        if not prefixed:  # the same on every rank: a batch without prefixes
            return tuple(torch.zeros(s, dtype=t, device=read.device)
                         for s, t in zip(shapes, (torch.float32, self.conv.dtype))), 0
        if group.rank == src:
            j = self.linear_index[layer]
            rec, conv = _gather((self.recurrent[j], self.conv[j]), read)
            group.broadcast_(rec, src)
            group.broadcast_(conv, src)
            return (rec, conv), 0
        rec = torch.empty(shapes[0], dtype=torch.float32, device=read.device)
        conv = torch.empty(shapes[1], dtype=self.conv.dtype, device=read.device)
        group.broadcast_(rec, src)
        group.broadcast_(conv, src)
        return (rec, conv), rec.nbytes + conv.nbytes

    def write_states(self, layer: int, write: torch.Tensor, recurrent: torch.Tensor, conv: torch.Tensor) -> None:
        """Store every request's final states (every rank computed them; a rank that keeps
        the layer stores them)."""
        j = self.linear_index.get(layer)
        if j is not None:
            self.recurrent[j].index_copy_(0, write, recurrent)
            self.conv[j].index_copy_(0, write, conv.to(self.conv.dtype))


def _gather(pools: tuple[torch.Tensor, ...], slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each pool's rows at ``slots``, zero where the slot is -1."""
    given = slots >= 0
    safe = slots.clamp(min=0)
    out = []
    for p in pools:
        rows = p.index_select(0, safe)
        out.append(torch.where(given.view(-1, *([1] * (p.dim() - 1))), rows, torch.zeros_like(rows)))
    return tuple(out)


class HybridStorage(Storage):
    """The full layers' K/V (:class:`~graphcp.kv.storage.kv_heads.KVHeadsStorage` over
    them) and the linear layers' :class:`LinearStates` (module doc)."""

    def __init__(self, geometry: HybridGeometry, pool: PoolSpec, held: HeldLayers) -> None:
        self.geometry, self.held = geometry, held
        #: the served full-attention layers (whose K/V the exchange moves)
        self.full_layers = tuple(geometry.of_kind(held.served, FULL))
        self.kv = KVHeadsStorage(geometry.kv, pool, held, self.full_layers, _NO_KV)
        self.pool, self.layout = self.kv.pool, self.kv.layout
        self.states = LinearStates(geometry, pool, held)
        self.state_layers = frozenset(geometry.of_kind(held.served, LINEAR))
        self.layer, self.layer_pools, self.write = self.kv.layer, self.kv.layer_pools, self.kv.write
        self.token_values, self.page_pools, self.read_span = self.kv.token_values, self.kv.page_pools, self.kv.read_span
        self.write_span = self.kv.write_span

    @classmethod
    def create(cls, geometry: HybridGeometry, pool: PoolSpec, held: HeldLayers) -> "HybridStorage":
        return cls(geometry, pool, held)

    @classmethod
    def pool_bytes(cls, geometry: HybridGeometry, pool: PoolSpec, held: HeldLayers) -> int:
        full = geometry.of_kind(held.served, FULL)
        linear = [i for i in geometry.of_kind(held.served, LINEAR) if i in held.held]
        slots = 2 * geometry.state_slots + geometry.verify_rows
        states = len(linear) * slots * geometry.linear.state_bytes(itemsize(pool.dtype))
        return KVHeadsStorage.pool_bytes(geometry.kv, pool, held, full) + states

    def exchange(self, placement_exchange: str) -> str:
        """The full layers store and attend through the mode's exchange, wrapped with the
        linear layers' scan (graphcp.model.hybrid.exchange)."""
        return f"hybrid+{placement_exchange}"

    def state_pools(self) -> dict[str, torch.Tensor]:
        return self.states.pools()

    def read_state(self, row: int, layer: int) -> tuple[torch.Tensor, ...]:
        """A linear layer's ``conv`` ``[conv_dim, K]`` and float32 ``recurrent`` ``[Hv, d_k,
        d_v]`` (new tensors; the committed slot)."""
        s = self.states
        slot = s.committed_slot(row)
        j = s.linear_index[layer]
        return s.conv[j, slot].t().contiguous(), s.recurrent[j, slot].clone()


    def write_state(self, row: int, layer: int, values: tuple[torch.Tensor, ...]) -> None:
        """A linear layer's ``conv`` ``[conv_dim, K]`` and ``recurrent`` (as :meth:`read_state`
        returns them) as the request's committed state (a layer this rank keeps)."""
        conv, recurrent = values
        s = self.states
        slot = s.committed_slot(row)
        j = s.linear_index[layer]
        s.conv[j, slot] = conv.t().to(s.conv.dtype)
        s.recurrent[j, slot] = recurrent.to(torch.float32)


_NO_KV = "is a linear-attention layer: it has no K/V"
