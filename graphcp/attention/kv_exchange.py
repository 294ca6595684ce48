"""How a forward's layers store their K/V and attend: one exchange per way a cache mode
moves K/V, named by the cache class's ``exchange`` (graphcp.kv.paged.PagedKVCache).

- ``all-gather`` (the replicated and layer-split caches, and the families' caches that
  store rows of their own): the body's first step all-gathers the slot mapping once per forward; each
  layer all-gathers every rank's K/V rows (one collective, inside the captured segment)
  and writes them to this rank's cache; attention (in the break) fetches the cached
  prefix a layer-split cache does not hold, then runs the backend over the local cache.
- ``ring`` (the token-sharded cache): a rank writes its own rows to its own pool (no
  collective) and attends by the forward's pass-KV or pass-Q ring, merged by LSE.

A forward runs one phase (graphcp.attention.phase): an exchange's methods are its prefill
phase, and :attr:`KVExchange.decode` its decode phase (docs/decode.md,
graphcp.attention.decode.phases): every rank holds every new row, writes the ones its
cache keeps, and attends over what it holds; the all-gather's caches attend locally, the
ring's merge the ranks' partial outputs by their LSE.

An exchange has a host side too, its :attr:`~KVExchange.planner`: the batch preparer
asks it for this rank's inputs (token ids, positions, cache slots, the attention
metadata and the exchange's own per-forward plan). A forward's state is one
:class:`KVForward`: the cache, the exchange, the backend and its metadata, this rank's
slots, the plan and the phase; the layers call its methods and never ask which mode or
phase runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import numpy as np
import torch

from graphcp.attention.base import Attention, AttentionBackend, AttentionMetadata, RankInputs
from graphcp.attention.decode.phases import LocalDecode, MergedDecode
from graphcp.attention.phase import PREFILL, ExchangePhase, Phase
from graphcp.attention.ring.attention import RINGS, RingAttention
from graphcp.attention.ring.plan import RingPlan, RingPlanner
from graphcp.cp import Plan
from graphcp.dist import CPGroup
from graphcp.jit import host_kernel
from graphcp.kv.layout import write_kv
from graphcp.kv.page_table import SCRATCH_PAGE
from graphcp.kv.paged import PagedKVCache
from graphcp.nvtx_ranges import nvtx_range


@dataclass
class KVForward:
    """One forward's KV state: what a layer stores and attends through (the forward
    context's exchange group). ``plan``: the exchange's per-forward plan; ``prefix_pages``:
    the batch's cached-prefix pages a cache that does not keep every layer fetches;
    ``phase``: which of the exchange's phases the layers run (``ops``, set from it)."""

    cache: PagedKVCache
    exchange: "KVExchange"
    group: CPGroup
    #: the forward's attention (a backend over K/V heads, which :meth:`attend` runs; a
    #: family's own takes the cache, and its layers call it: graphcp.attention.base)
    backend: Attention
    meta: AttentionMetadata
    slots: torch.Tensor  # [capacity] int64: this rank's rows' cache slots (-1: padding)
    plan: Any = None
    prefix_pages: torch.Tensor | None = None
    phase: Phase = PREFILL
    #: every rank's slots, rank-major (the all-gather's first step; None before it)
    gathered_slots: torch.Tensor | None = None
    #: a decode step's per-request state slots ``[2, capacity]`` int64 (each row's read and write
    #: slot, graphcp.kv.decode.state_rows), on a storage with states; None otherwise
    state_slots: torch.Tensor | None = None
    #: the rows a request gives the step, in order (a verify step's k + 1: they advance the
    #: request's states one after the other, request-major; graphcp.kv.decode.stack_steps)
    state_rows: int = 1

    def __post_init__(self) -> None:
        #: the phase's operations (the exchange itself in a prefill): chosen once a forward
        self.ops: ExchangePhase = self.exchange.ops(self.phase)

    def prepare(self) -> None:
        """Host-side planning of the forward, before the body runs."""
        self.ops.prepare(self)

    def begin(self) -> None:
        """The body's first step (inside the captured segment)."""
        self.ops.begin(self)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Store one layer's K/V rows ``[rows, heads, dim]``; the bytes this rank received."""
        return self.ops.store(self, layer, k, v)

    def store_rows(self, layer: int, rows: torch.Tensor) -> int:
        """Store one layer's cache rows ``[rows, values]`` (a family whose cache writes rows
        of its own, such as a latent); the bytes this rank received."""
        return self.ops.store_rows(self, layer, rows)

    def fetch_prefix(self, layer: int) -> int:
        """Before a layer's attention: the cached prefix its cache does not keep (the bytes
        received; 0 for a cache that keeps every layer)."""
        return self.cache.fetch_prefix(layer, self.prefix_pages, self.group)

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> int:
        """Attend this rank's query rows of one layer into ``out``; the bytes received."""
        return self.ops.attend(self, layer, q, out)

    def attend_own(self, layer: int, run: Callable[[], None], outs: Sequence[torch.Tensor]) -> int:
        """A family's own attention of one layer (``run()`` writes ``outs``) where the
        phase runs it (ExchangePhase.attend_own); the bytes received."""
        return self.ops.attend_own(self, layer, run, outs)


class KVExchange(ExchangePhase):
    """How one kind of cache moves K/V (see the module doc): its methods are the prefill
    phase's operations, :attr:`decode` the decode phase's."""

    #: the cache classes' ``exchange`` this implements
    name: ClassVar[str] = ""
    #: the host side: this rank's inputs of a planned batch
    planner: Any
    #: what a decode step's layers store and attend through over this exchange's cache
    #: (graphcp.attention.decode.phases); None: none (decode is refused for its caches)
    decode: ClassVar[ExchangePhase | None] = None

    @classmethod
    def build(cls, make_backend: Callable[[], Attention], group: CPGroup, device: torch.device,
              planner: Callable[[], RingPlanner]) -> "KVExchange":
        """The engine's exchange (:func:`make_exchange`'s arguments)."""
        return cls()

    def ops(self, phase: Phase) -> ExchangePhase:
        """The operations of ``phase``: this exchange's own in a prefill, :attr:`decode`'s."""
        if phase == PREFILL:
            return self
        if self.decode is None:
            raise NotImplementedError(f"the {self.name} exchange has no {phase} phase")
        return self.decode

    def inert_plan(self, group) -> Any:
        """The plan of a batch without rows (what a graph is captured with)."""
        return None

    def reserve(self, capacity: int, cache: PagedKVCache, layer: int, heads: int, dim: int,
                dtype: torch.dtype) -> None:
        """Before a bucket's capture: what a replay of ``capacity`` rows must not allocate."""

    def store_rows(self, fwd: KVForward, layer: int, rows: torch.Tensor) -> int:
        raise NotImplementedError(f"the {self.name} exchange stores K/V heads, not cache rows")

    def describe(self, plan: Any) -> dict[str, Any]:
        """A forward's figures (ForwardInfo.stats): the exchange it ran."""
        return {"exchange": self.name}

    def setting(self) -> str:
        """The exchange as configured (engine.stats()'s ``exchange``)."""
        return self.name


# ---- all-gather ---------------------------------------------------------------------
class AllGatherPlanner:
    """This rank's inputs of a batch over a cache every rank writes whole: one compiled
    pass over its segments (:func:`_rank_inputs`)."""

    def rank_inputs(self, plan: Plan, kv: PagedKVCache, seq_ids: list[int], rank: int, flat: np.ndarray,
                    device: torch.device, seq_rows: np.ndarray | None = None) -> RankInputs:
        if seq_rows is None:
            seq_rows = kv.table_rows(seq_ids)
        rp = plan.rank(rank)
        # attention metadata written in place into one packed buffer; this rank's
        # segments read pages up to their kv lengths only
        kv_lens = rp.seg_kv_len
        max_q, max_kv = rp.max_lens
        buf, cu, kvl, pt = AttentionMetadata.host_buffers(kv_lens.shape[0], max(1, kv.pages_for(max_kv)))
        per_row = np.empty((3, rp.num_rows), dtype=np.int64)  # token ids, positions, cache slots
        _rank_inputs(kv.table, kv.page_size, seq_rows, rp.seg_request, kv_lens, rp.seg_shift, rp.cu_seqlens_q,
                     flat, per_row, cu, kvl, pt)
        meta = AttentionMetadata._live(cu, kvl, pt, kv.page_size, max_q, max_kv, device, buf)
        return RankInputs(per_row[0], per_row[1], per_row[2], meta, pt)


class AllGather(KVExchange):
    name = "all-gather"
    #: every rank keeps what it attends over (a layer-split layer: its owner)
    decode = LocalDecode()

    def __init__(self) -> None:
        self.planner = AllGatherPlanner()

    def begin(self, fwd: KVForward) -> None:
        """Every rank's local slot mapping, rank-major: one small all-gather per forward
        (``C * capacity`` int64), shared by all layers."""
        with nvtx_range("kv_slots_gather", category="comm"):
            fwd.gathered_slots = fwd.group.all_gather_rows(fwd.slots)

    @staticmethod
    def _slots(fwd: KVForward) -> torch.Tensor:
        if fwd.gathered_slots is None:
            raise RuntimeError("the KV exchange needs the gathered slot mapping: run KVForward.begin() first")
        return fwd.gathered_slots

    def store(self, fwd: KVForward, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """All-gather every rank's K/V rows of one layer (one collective for both) and
        write them to this rank's cache through the gathered slot mapping. The bytes are
        counted when this runs: eagerly, or once at capture (the runner adds a captured
        segment's count to each replay)."""
        slots = self._slots(fwd)
        with nvtx_range(f"kv_exchange[{layer}]", category="comm"):
            kv = torch.cat([k, v], dim=1)  # [n, 2H, D]
            gathered = fwd.group.all_gather_rows(kv)
            kh = k.shape[1]
            write_kv(fwd.cache.layer(layer), gathered[:, :kh], gathered[:, kh:], slots, fwd.cache.layout)
        return gathered.nbytes - kv.nbytes

    def store_rows(self, fwd: KVForward, layer: int, rows: torch.Tensor) -> int:
        """All-gather every rank's cache rows of one layer and write them (the cache's ``write``)."""
        slots = self._slots(fwd)
        with nvtx_range(f"kv_exchange[{layer}]", category="comm"):
            gathered = fwd.group.all_gather_rows(rows)
            fwd.cache.write(layer, gathered, slots)
        return gathered.nbytes - rows.nbytes

    def attend(self, fwd: KVForward, layer: int, q: torch.Tensor, out: torch.Tensor) -> int:
        got = fwd.fetch_prefix(layer)
        fwd.backend.forward(q, fwd.cache.layer(layer), fwd.meta, out)
        return got


def _rank_inputs_np(table: np.ndarray, page_size: int, seq_rows: np.ndarray, seg_request: np.ndarray,
                    seg_kv_len: np.ndarray, seg_shift: np.ndarray, seg_cu: np.ndarray, flat: np.ndarray,
                    per_row: np.ndarray, cu: np.ndarray, kv_lens: np.ndarray, page_table: np.ndarray) -> None:
    """:func:`_rank_inputs` as whole-array numpy (the form that runs without numba)."""
    s = seg_kv_len.shape[0]
    copied = min(page_table.shape[1], table.shape[1])
    rows = seq_rows[seg_request]
    cu[: s + 1] = seg_cu[: s + 1]
    kv_lens[:s] = seg_kv_len
    page_table[:, :copied] = table[rows, :copied]
    page_table[:, copied:] = SCRATCH_PAGE
    lens = seg_cu[1 : s + 1] - seg_cu[:s]
    seg = np.repeat(np.arange(s), lens)  # each live row's segment
    i = np.arange(int(seg_cu[0]), int(seg_cu[s]), dtype=np.int64)  # the segments' rows are consecutive
    position = seg_shift[1, seg] + i
    per_row[0, i] = flat[seg_shift[0, seg] + i]
    per_row[1, i] = position
    per_row[2, i] = table[rows[seg], position // page_size].astype(np.int64) * page_size + position % page_size


@host_kernel(fallback=_rank_inputs_np)
def _rank_inputs(table, page_size, seq_rows, seg_request, seg_kv_len, seg_shift, seg_cu, flat, per_row, cu, kv_lens,
                 page_table):
    """One rank's host inputs in one compiled pass over its segments (segment ``s``:
    local rows ``seg_cu[s] .. seg_cu[s + 1]``, consecutive rows of request
    ``seg_request[s]`` whose row of the cache's dense ``table`` is ``seq_rows[...]``;
    ``seg_shift`` [2, S] their global row and position less the local index; the
    last row sees ``seg_kv_len[s]`` keys): each row's token id (``flat[global
    row]``), position and cache slot into ``per_row`` [3, n]; the attention
    metadata's ``cu`` [S + 1], ``kv_lens`` [S] and ``page_table`` [S, width] (int32;
    columns past the table's are scratch). The pages must be reserved."""
    width = page_table.shape[1]
    copied = min(width, table.shape[1])
    ids, positions, slots = per_row[0], per_row[1], per_row[2]
    for s in range(seg_kv_len.shape[0]):
        row = seq_rows[seg_request[s]]
        cu[s] = seg_cu[s]
        kv_lens[s] = seg_kv_len[s]
        for p in range(copied):
            page_table[s, p] = table[row, p]
        for p in range(copied, width):
            page_table[s, p] = SCRATCH_PAGE
        first, last = seg_cu[s], seg_cu[s + 1]
        if first == last:
            continue
        shift, position = seg_shift[0, s], seg_shift[1, s] + first
        page, offset = position // page_size, position % page_size  # then walked: no division a row
        base = table[row, page] * page_size
        for i in range(first, last):
            ids[i] = flat[shift + i]
            positions[i] = position
            slots[i] = base + offset
            position += 1
            offset += 1
            if offset == page_size:
                offset = 0
                page += 1
                if i + 1 < last:
                    base = table[row, page] * page_size
    cu[seg_kv_len.shape[0]] = seg_cu[seg_kv_len.shape[0]]


# ---- ring ---------------------------------------------------------------------------
class Ring(KVExchange):
    """A token-sharded cache's exchange: each rank stores its own rows, attention runs the
    forward's ring (pass-KV or pass-Q, chosen per batch by the planner)."""

    name = "ring"
    #: each rank holds a share of every request: partial attention, merged by LSE
    decode = MergedDecode()

    def __init__(self, make_backend: Callable[[], AttentionBackend], group, device: torch.device,
                 planner: RingPlanner) -> None:
        self.planner = planner
        rings = tuple(RINGS) if planner.exchange == "auto" else (planner.exchange,)
        self.ring = RingAttention(make_backend, group, device, rings)

    @classmethod
    def build(cls, make_backend: Callable[[], Attention], group: CPGroup, device: torch.device,
              planner: Callable[[], RingPlanner]) -> "Ring":
        # a ring's steps attend K/V heads: a token-sharded cache holds nothing else
        # (graphcp/combinations.py), so its attention is an AttentionBackend
        return cls(make_backend, group, device, planner())

    def inert_plan(self, group) -> RingPlan:
        return RingPlan.inert(group.size, group.rank)

    def prepare(self, fwd: KVForward) -> None:
        self.ring.prepare(fwd.plan)

    def reserve(self, capacity: int, cache: PagedKVCache, layer: int, heads: int, dim: int,
                dtype: torch.dtype) -> None:
        self.ring.reserve(capacity, cache.layer(layer), heads, dim, dtype)

    def store(self, fwd: KVForward, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """This rank's own rows into its own pool: no collective."""
        write_kv(fwd.cache.layer(layer), k, v, fwd.slots, fwd.cache.layout)
        return 0

    def attend(self, fwd: KVForward, layer: int, q: torch.Tensor, out: torch.Tensor) -> int:
        return self.ring.attend(fwd.plan, fwd.backend, fwd.cache.layer(layer), q, out)

    def setting(self) -> str:
        return self.planner.exchange  # auto | pass-kv | pass-q

    def describe(self, plan: RingPlan) -> dict[str, Any]:
        out: dict[str, Any] = {"exchange": plan.exchange}
        if plan.choice is not None:
            out["exchange_choice"] = plan.choice.as_dict()
        return out


EXCHANGES: dict[str, type[KVExchange]] = {AllGather.name: AllGather, Ring.name: Ring}


def register_exchange(cls: type[KVExchange]) -> type[KVExchange]:
    """Make ``cls`` the exchange of the caches whose ``exchange`` is ``cls.name`` (a new cache mode's)."""
    EXCHANGES[cls.name] = cls
    return cls


def make_exchange(cache: PagedKVCache, group: CPGroup, device: torch.device, make_backend: Callable[[], Attention],
                  planner: Callable[[], RingPlanner]) -> KVExchange:
    """The exchange ``cache``'s mode stores and attends through. ``make_backend()``: one
    more backend like the forward's (a ring step plans its own metadata); ``planner()``:
    the ring's per-batch planner (an exchange that plans asks)."""
    return EXCHANGES[cache.exchange].build(make_backend, group, device, planner)
