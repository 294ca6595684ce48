"""Each phase's graphs: what a bucket is, which one a prepared batch replays, the static
buffers it reads and writes, and the contexts of its capture, replay and same-bucket
eager forward. The runner (graphcp.runtime.capture.runner) captures, checks and replays
every phase's buckets the same way, keyed by (phase, bucket).

- :class:`PrefillGraphs`: a bucket is a capacity of local rows (``BucketSet``): a batch
  runs the smallest that holds its largest rank's rows, unless it pads past the factor.
  Breakable graphs break at each layer's attention (it reads the live batch's
  metadata); a full graph keeps it inside, over static segment metadata. Each bucket is
  checked at capture, on a synthetic batch (graphcp.runtime.capture.selfcheck).
- :class:`DecodeGraphs`: a bucket is a batch size (``RuntimeConfig.decode_buckets``, 1,
  2, 4, ..., 64 by default) and a page width: the smallest power of two of pages, at most
  the cache's, that holds the step's longest share of a request on any rank (every
  rank's the same: the ledger's largest), so a step reads at most twice the pages its
  requests hold. Attention and merge are inside the graph: the attention is the engine's
  backend's decode kernel (graphcp.attention.base.DecodeKernel, chosen by the registry:
  Triton's, FlashInfer's decode wrapper, trtllm-gen's decode, or the torch reference
  :class:`~graphcp.attention.decode.paged.PagedDecodeAttention`) over the bucket's static
  page table and lengths, or a family's own attention's decode graph form
  (``Attention.decode_graph_attention``: DSA's and V4's sparse attention over the
  bucket's pages); the merge's collectives have the bucket's shapes (the bucket's merge:
  a step on it runs that plan); a layer that sizes work on the host (the MoE ``ep``
  exchange) stays a break. A step larger than every
  bucket runs eagerly and says so. Each bucket is checked on its first live replay: its
  requests' KV is the cache's, so no synthetic batch is needed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from graphcp.attention.base import Attention, AttentionMetadata, DecodeKernel
from graphcp.attention.decode.paged import PagedDecodeAttention
from graphcp.attention.phase import DECODE, PREFILL, Phase
from graphcp.attention.registry import AttentionLimits, make_decode_attention, registered_decode_kernel
from graphcp.attention.staging import to_device
from graphcp.config import RuntimeConfig
from graphcp.model.forward_context import AuxCapture, ForwardContext
from graphcp.runtime.batch import BatchPreparer, PreparedBatch, Request
from graphcp.runtime.body import Body
from graphcp.runtime.capture.buckets import FALLBACK_REQUESTS, FALLBACK_TOO_LARGE, BucketSet, Selection
from graphcp.runtime.capture.selfcheck import SyntheticBatch, synthetic_batch
from graphcp.runtime.capture.static_buffers import BucketView, DecodeBuffers, DecodeView, StaticBuffers


@dataclass
class BucketCaptureStats:
    capacity: int  # the bucket's rows (a decode bucket's requests)
    capture_s: float
    segments: int
    breaks: int
    ops_per_segment: list
    pool_bytes: int = 0
    #: the capture self-check: its time (None: not run) and why it was skipped
    verify_s: float | None = None
    verify_skipped: str | None = None


@dataclass
class RunnerStats:
    replays: int = 0
    eager: int = 0
    fallbacks: Counter = field(default_factory=Counter)
    replays_per_bucket: Counter = field(default_factory=Counter)
    captures: list[BucketCaptureStats] = field(default_factory=list)


class PhaseGraphs:
    """One phase's graphs (see the module doc): the hooks the runner calls, and what it
    keeps of the phase (its graphs by bucket, its counters)."""

    phase: ClassVar[Phase]
    #: when a bucket's replay is checked against the same-bucket eager forward
    check_at: ClassVar[Literal["capture", "first_replay"]]
    #: which breaks a capture keeps (graphcp.runtime.capture.breakable.capture_breakable)
    breakable: Any = True
    buffers: Any

    def __init__(self, body: Body) -> None:
        self.body = body
        #: bucket -> its captured graph (the runner's)
        self.graphs: dict[Hashable, Any] = {}
        self.stats = RunnerStats()
        self.verified: set = set()  # buckets whose self-check passed
        #: bucket -> the static views whose inputs were checked against its capture
        self.checked: dict[Hashable, Any] = {}

    @property
    def fallbacks(self) -> Counter:
        """Why forwards of this phase ran eagerly: reason -> forwards."""
        return self.stats.fallbacks

    def select(self, prep: PreparedBatch, rows: int | None = None, fallback: str | None = None) -> Selection:
        """The bucket capacity ``prep`` replays, or why it runs eagerly."""
        raise NotImplementedError

    def key(self, prep: PreparedBatch, capacity: int) -> Hashable:
        """The bucket of ``prep`` of ``capacity`` rows."""
        return capacity

    def rows(self, key: Hashable) -> int:
        """A bucket's rows."""
        return key

    def reserve(self, key: Hashable) -> None:
        """Before a bucket's capture: what its replays must not allocate."""

    def fill(self, prep: PreparedBatch | None, key: Hashable, hidden_in: torch.Tensor | None = None):
        """``prep``'s rows into the bucket's static views (None: all inert); the views."""
        raise NotImplementedError

    def context(self, prep: PreparedBatch | None, key: Hashable, view, stats: dict | None = None,
                aux: AuxCapture | None = None, eager: bool = False) -> ForwardContext:
        """The context of a capture (``prep`` None), a replay, or the same-bucket eager
        forward (``eager``) on the bucket's views."""
        raise NotImplementedError

    def aux(self, view) -> AuxCapture | None:
        """Where a capture copies auxiliary hidden states (None: none)."""
        return None

    def output(self, view, prep: PreparedBatch) -> torch.Tensor:
        """The forward's rows of the bucket's output."""
        return view.hidden_out

    def compared(self, key: Hashable) -> dict[str, torch.Tensor]:
        """Static outputs the self-check compares besides the rows and the pages."""
        return {}

    def bucket_stats(self, key: Hashable) -> dict[str, Any]:
        """Figures a replay of bucket ``key`` reports besides the bytes it moves."""
        return {}

    def check_name(self, key: Hashable) -> str:
        """What a failed self-check of bucket ``key`` on a live batch says it compared."""
        return f"self-check of bucket {key}: the replay differs from the same forward run eagerly on the bucket"

    def written_pages(self, prep: PreparedBatch) -> torch.Tensor:
        """The pages the self-check compares: those the forward of ``prep`` may write here."""
        raise NotImplementedError

    def written_states(self, prep: PreparedBatch) -> torch.Tensor | None:
        """The per-request state slots the self-check compares (a storage's with states:
        those the forward of ``prep`` writes), or None: none."""
        return None

    def range_name(self, what: str, key: Hashable) -> str:
        """The NVTX range of a capture or replay of bucket ``key``."""
        return f"{what}[{key}]"


class PrefillGraphs(PhaseGraphs):
    """A prefill's graphs (see the module doc)."""

    phase = PREFILL
    check_at = "capture"

    def __init__(self, body: Body, preparer: BatchPreparer, buckets: BucketSet, rt: RuntimeConfig,
                 max_context: int) -> None:
        super().__init__(body)
        self.full = rt.graph == "full"
        self.breakable = not self.full  # a full graph keeps its attention inside
        self.preparer, self.buckets = preparer, buckets
        self.max_context, self.max_requests = max_context, rt.max_requests
        cfg, model = body.model.cfg, body.model
        self.max_pages = -(-max_context // body.kv.page_size)
        #: the auxiliary hidden states every captured body copies out (this stage's
        #: share of RuntimeConfig.aux_hidden_layers): a graph knows which layers it copies
        self.aux_layers = tuple(i for i in rt.aux_hidden_layers if i in model.stage.layers)
        self.buffers = StaticBuffers(
            buckets.largest, body.group.size, model.attn_cfg.num_heads, cfg.head_dim, cfg.hidden_size,
            2 * rt.max_requests, self.max_pages, model.dtype, body.device, moe_rows=model.exchanges,
            hidden_in=body.takes_hidden, aux_layers=len(self.aux_layers),
            extra_rows=model.static_rows(), hidden_in_size=model.handoff_size,
            hidden_out_size=model.output_size,
        )
        self._static_metas: dict[int, AttentionMetadata] = {}  # built once a bucket, not per replay

    def select(self, prep: PreparedBatch, rows: int | None = None, fallback: str | None = None) -> Selection:
        """``rows``: the rows the bucket must hold (attention DP: the largest replica's, so
        every replica replays the same bucket; default this batch's); ``fallback``: a
        fallback the ranks agreed on (attention DP: one replica's :meth:`own_fallback`
        makes every replica run eagerly, so their collectives keep the same sizes)."""
        sel = self.buckets.select(rows or prep.plan.max_local_rows)
        reason = fallback if fallback is not None else self.own_fallback(prep)
        if sel.graph and reason is not None:
            sel = Selection(sel.required, None, reason)
        return sel

    def own_fallback(self, prep: PreparedBatch) -> str | None:
        """What rules this rank's batch out of the graphs whatever the rows it is padded
        to, or None: a full graph reads static segment metadata sized for max_requests."""
        if self.full and prep.meta.num_segments > self.buffers.max_segments:
            return FALLBACK_REQUESTS
        return None

    def reserve(self, key: int) -> None:
        self.body.reserve(key)  # a replay's ring breaks then allocate nothing

    def capture_order(self, up_to: int | None = None) -> list[int]:
        """The buckets to capture, largest first (later, smaller captures reuse the shared
        pool; ``up_to``: only those of at most that many rows)."""
        return sorted((c for c in self.buckets.capacities if up_to is None or c <= up_to), reverse=True)

    def static_meta(self, capacity: int) -> AttentionMetadata:
        """The attention metadata bucket ``capacity`` is captured with (what a graph captured
        after the body's, an EAGLE-3 draft's, is captured and replayed with). Breakable:
        an empty batch (the break reads live metadata at replay). Full graph: the static
        device buffers, whose host fields are static bounds (a captured kernel may size
        its grid by them)."""
        cached = self._static_metas.get(capacity)
        if cached is None:
            cached = self._static_metas[capacity] = self._build_static_meta(self.buffers.view(capacity))
        return cached

    def _build_static_meta(self, view: BucketView) -> AttentionMetadata:
        S, page_size, device = self.buffers.max_segments, self.body.kv.page_size, self.body.device
        if not self.full:
            return AttentionMetadata.from_host(np.zeros(1), np.zeros(0), np.zeros((0, 1)), page_size, device)
        return AttentionMetadata(
            cu_seqlens_q_host=np.zeros(S + 1, dtype=np.int32), kv_lens_host=np.zeros(S, dtype=np.int32),
            page_table_host=np.zeros((S, self.max_pages), dtype=np.int32), page_size=page_size,
            max_q_len=view.capacity, max_kv_len=self.max_pages * page_size,
            device=device, device_tensors=(view.cu_seqlens_q, view.kv_lens, view.page_table),
        )

    def fill(self, prep: PreparedBatch | None, key: int, hidden_in: torch.Tensor | None = None) -> BucketView:
        if prep is None:  # inert: no row in any segment
            empty = np.zeros(0, dtype=np.int64)
            seg = ((np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros((0, 1), np.int32)) if self.full
                   else (None,) * 3)
            return self.buffers.fill(key, empty, empty, empty, *seg)
        seg = (prep.meta.cu_seqlens_q_host, prep.meta.kv_lens_host, prep.seg_page_table) if self.full else (None,) * 3
        return self.buffers.fill(key, prep.ids, prep.positions, prep.slots, *seg, hidden_in=hidden_in)

    def context(self, prep: PreparedBatch | None, key: int, view: BucketView, stats: dict | None = None,
                aux: AuxCapture | None = None, eager: bool = False) -> ForwardContext:
        # a capture runs on the bucket's static metadata, a full graph's replay too; a
        # breakable replay's breaks and the eager forward read the live batch's
        static = prep is None or (self.full and not eager)
        return self.body.context(prep, view.kv_slots, view, meta=self.static_meta(key) if static else None,
                                 stats=stats, aux=aux)

    def aux(self, view: BucketView) -> AuxCapture | None:
        return AuxCapture(self.aux_layers, view.aux_out) if self.aux_layers else None

    def aux_rows(self, capacity: int) -> torch.Tensor | None:
        """The auxiliary hidden states the last replay of bucket ``capacity`` copied
        out: [capacity, len(aux_layers), hidden] (a static view), or None."""
        return self.buffers.view(capacity).aux_out

    def compared(self, key: int) -> dict[str, torch.Tensor]:
        return {"aux_hidden": self.aux_rows(key)} if self.aux_layers else {}

    def written_pages(self, prep: PreparedBatch) -> torch.Tensor:
        kv = self.body.kv
        pages = [p for s in prep.seq_ids for p in kv.handle(s).pages]
        return to_device(np.array(pages, dtype=np.int64), self.body.device)

    # ---- the self-check's input: a synthetic batch (graphcp.runtime.capture.selfcheck) ----
    def synthetic_spec(self, capacity: int) -> SyntheticBatch | None:
        """The synthetic batch that checks bucket ``capacity`` (None: the pool holds none)."""
        kv = self.body.kv
        return synthetic_batch(capacity, self.preparer.layout, kv.num_free_pages, kv.page_size, self.max_requests,
                               self.max_context)

    @contextmanager
    def synthetic(self, capacity: int, spec: SyntheticBatch) -> Iterator[tuple[PreparedBatch, torch.Tensor | None]]:
        """The batch ``spec`` prepared (after an eager forward of its first request's
        prefix), with a later pipeline stage's seeded input rows; its KV given back after.
        The same on every rank by construction: no consistency check."""
        body, kv, prep_ = self.body, self.body.kv, self.preparer
        rng = np.random.default_rng(capacity)
        vocab = body.model.cfg.vocab_size
        prefix = None
        if spec.prefix_len:  # an earlier forward's KV: the batch's first request extends it
            first = prep_.prepare([Request(rng.integers(0, vocab, spec.prefix_len))], verified=True)
            try:
                body.eager(first, first.plan.max_local_rows, self.synthetic_input(first, rng))
            except BaseException:
                prep_.abort(first)
                raise
            prefix = kv.handle(first.seq_ids[0])
        try:
            prep = prep_.prepare([Request(rng.integers(0, vocab, n), prefix if j == 0 else None)
                                  for j, n in enumerate(spec.extend_lens)], verified=True)
            try:
                yield prep, self.synthetic_input(prep, rng)
            finally:
                prep_.abort(prep)
        finally:
            if prefix is not None:
                kv.release(prefix)

    def synthetic_input(self, prep: PreparedBatch, rng: np.random.Generator) -> torch.Tensor | None:
        """Seeded input rows for a later pipeline stage's body, to check its replay
        against its eager body without the earlier stages (None on the first)."""
        if not self.body.takes_hidden:
            return None
        n = prep.ids.shape[0]
        rows = torch.from_numpy(rng.standard_normal((n, self.body.model.handoff_size), dtype=np.float32))
        return rows.to(device=self.body.device, dtype=self.body.model.dtype)


def page_bucket(pages: int, most: int) -> int:
    """The smallest power of two >= ``pages`` (>= 1), at most ``most``."""
    return min(most, 1 << max(0, int(pages) - 1).bit_length())


class DecodeGraphs(PhaseGraphs):
    """A decode step's graphs (see the module doc); a bucket is ``(requests, pages)``."""

    phase = DECODE
    check_at = "first_replay"

    def __init__(self, body: Body, buckets: tuple[int, ...], staging=None, aux_layers: tuple[int, ...] = ()) -> None:
        super().__init__(body)
        self.buckets = tuple(buckets)
        self.width = body.kv.table_width
        cfg = body.model.cfg
        #: the auxiliary hidden states every captured step copies out (the prefill graphs'
        #: layers: an EAGLE-3 draft's inputs, which its re-run over a verify step's rows reads)
        self.aux_layers = tuple(aux_layers)
        self.buffers = DecodeBuffers(self.buckets[-1], self.width, cfg.hidden_size, body.model.dtype, body.device,
                                     staging, len(self.aux_layers))
        #: whether the cache keeps per-request state (a recurrent layer's): its step's slots are static rows too
        self.states = bool(body.kv.state_pools())
        largest = self.buckets[-1]
        #: the decode kernel of the engine's backend over K/V heads, one for every bucket (None
        #: for a family's own attention, whose decode graph form each bucket makes: attention())
        self.kernel: Attention | None = body.decode_attention or (make_decode_attention(
            body.attention, body.device, AttentionLimits(max_segments=largest, max_q_rows=largest,
                                                         max_pages_per_segment=self.width, dtype=body.model.dtype))
            if registered_decode_kernel(body.attention) is not None else None)
        self._attentions: dict[tuple[int, int], Attention] = {}
        self._metas: dict[tuple[int, int], AttentionMetadata] = {}
        self._plans: dict[int, Any] = {}
        self._replays: dict[tuple[int, int], ForwardContext] = {}

    @staticmethod
    def breakable(name: str) -> bool:
        """False for the breaks a decode graph keeps: every one but plain attention (which a
        decode graph captures) sizes its work on the host."""
        return name != "attention"

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket that holds ``rows`` requests (None: larger than every bucket)."""
        return next((b for b in self.buckets if b >= rows), None)

    def pages(self, prep: PreparedBatch) -> int:
        """The step's page bucket: its longest request share on any rank (every rank's the
        same: the ledger's largest; a replicated cache's, its own)."""
        kv = self.body.kv
        return page_bucket(kv.pages_for(kv.most_held(prep.decode.rows)), self.width)

    def select(self, prep: PreparedBatch, rows: int | None = None, fallback: str | None = None) -> Selection:
        rows = prep.rows
        capacity = self.bucket(rows)
        return Selection(rows, capacity, None if capacity is not None else FALLBACK_TOO_LARGE)

    def key(self, prep: PreparedBatch, capacity: int) -> tuple[int, int]:
        return capacity, self.pages(prep)

    def rows(self, key: tuple[int, int]) -> int:
        return key[0]

    def capture_order(self, pages: int | None = None) -> list[tuple[int, int]]:
        """Every batch-size bucket for the page bucket that holds ``pages`` (None: the
        widest), largest first."""
        width = self.width if pages is None else page_bucket(pages, self.width)
        return [(b, width) for b in sorted(self.buckets, reverse=True)]

    def plan(self, capacity: int) -> Any:
        """The bucket's merge: its collectives are captured with the bucket's rows."""
        got = self._plans.get(capacity)
        if got is None:
            got = self._plans[capacity] = self.body.plan_decode(capacity)
        return got

    def static_meta(self, key: tuple[int, int]) -> AttentionMetadata:
        """The bucket's static metadata: one segment a row over its static length and pages."""
        meta = self._metas.get(key)
        if meta is None:
            (capacity, width), ps, view = key, self.body.kv.page_size, self.buffers.view(*key)
            meta = self._metas[key] = AttentionMetadata(
                np.arange(capacity + 1, dtype=np.int32), np.zeros(capacity, dtype=np.int32),
                np.zeros((capacity, width), dtype=np.int32), ps, 1, width * ps, self.body.device,
                device_tensors=(view.cu_seqlens_q, view.kv_lens, view.page_table))
        return meta

    def attention(self, key: tuple[int, int]) -> Attention:
        """The bucket's attention over its static metadata: the paged decode attention over
        K/V heads (the engine's decode kernel), or a family's own attention's decode graph
        form (made once a bucket)."""
        got = self._attentions.get(key)
        if got is None:
            engine = self.body.attention
            got = engine.decode_graph_attention(self.static_meta(key)) or self.kernel
            if got is None:
                got = PagedDecodeAttention(engine.spec)
            self._attentions[key] = got
        return got

    def fill(self, prep: PreparedBatch | None, key: tuple[int, int], hidden_in: torch.Tensor | None = None
             ) -> DecodeView:
        """The step's rows into the bucket's buffers, and its plan the bucket's (a step on
        a decode graph merges as its bucket was captured to)."""
        if prep is not None:
            prep.kv_plan = self.plan(key[0])
        return self.buffers.fill(prep, *key, self.body.kv)

    def aux(self, view: DecodeView) -> AuxCapture | None:
        return AuxCapture(self.aux_layers, view.aux_out) if self.aux_layers else None

    def aux_rows(self, capacity: int) -> torch.Tensor | None:
        """The auxiliary hidden states the last replay of a bucket of ``capacity`` rows copied
        out: [capacity, len(aux_layers), hidden] (a static view), or None."""
        return None if self.buffers.aux_out is None else self.buffers.aux_out[:capacity]

    def context(self, prep: PreparedBatch | None, key: tuple[int, int], view: DecodeView, stats: dict | None = None,
                aux: AuxCapture | None = None, eager: bool = False) -> ForwardContext:
        attention = self.attention(key)
        if isinstance(attention, DecodeKernel):
            attention.bucket(key[0])
        if prep is None or eager:
            return self._context(prep, key, view, stats, aux)
        # a replay's: everything in it is the bucket's but the live rows and the figures,
        # so it is made once a bucket (no per-step Python on the replay path); a kernel
        # that plans on the host (FlashInfer's decode wrapper) plans every step
        ctx = self._replays.get(key)
        if ctx is None:
            ctx = self._replays[key] = self._context(prep, key, view, stats)
        elif isinstance(attention, DecodeKernel) and attention.plans_steps:
            attention.prepare(prep.meta)
        ctx.stats, ctx.inputs.live_rows = stats, prep.rows
        return ctx

    def _context(self, prep: PreparedBatch | None, key: tuple[int, int], view: DecodeView,
                 stats: dict | None, aux: AuxCapture | None = None) -> ForwardContext:
        return self.body.context(prep, view.kv_slots, phase=DECODE, meta=self.static_meta(key),
                                 attention=self.attention(key), stats=stats, aux=aux,
                                 state_slots=view.state_slots if self.states else None)

    def output(self, view: DecodeView, prep: PreparedBatch) -> torch.Tensor:
        return view.hidden_out[: prep.rows]

    def written_pages(self, prep: PreparedBatch) -> torch.Tensor:
        slots = prep.slots  # this rank's slot of each new token (-1: another rank stores it)
        return to_device(np.unique(slots[slots >= 0] // self.body.kv.page_size), self.body.device)

    def written_states(self, prep: PreparedBatch) -> torch.Tensor | None:
        if not self.states:
            return None
        return torch.from_numpy(prep.decode.states[1].copy()).to(self.body.device)

    def range_name(self, what: str, key: tuple[int, int]) -> str:
        return f"decode_{what}[{key[0]},{key[1]}]"

    def bucket_stats(self, key: tuple[int, int]) -> dict[str, Any]:
        return {"pages": key[1]}

    def check_name(self, key: tuple[int, int]) -> str:
        return (f"decode graph self-check of bucket {key[0]} requests x {key[1]} pages: the replay differs from the "
                "same step run eagerly on the bucket")
