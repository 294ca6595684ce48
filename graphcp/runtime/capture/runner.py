"""GraphRunner: capture the body per bucket, replay it, or say why a batch runs eagerly.

Capture: largest bucket first (so later, smaller captures reuse the shared
pool), warm-up runs before each capture, one :class:`BreakableGraph` per bucket.
Replay: select the bucket from the plan, fill the static buffers, check the
inputs against what was captured, run the host-side attention planning, replay.
Self-check (``RuntimeConfig.verify_capture``): each new bucket is replayed once on
a synthetic batch and compared bitwise with the same-bucket eager body.

The runner is built from the parts it uses (the body, the batch preparer for its
self-check, the buckets and the graph settings), never from the engine.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from graphcp.attention.base import AttentionMetadata
from graphcp.config import RuntimeConfig
from graphcp.errors import ConfigError
from graphcp.model.forward_context import KV_RECEIVED, AuxCapture
from graphcp.model.llama import DecoderModel
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.batch import BatchPreparer, ForwardInfo, PreparedBatch, Request
from graphcp.runtime.body import Body
from graphcp.runtime.capture.breakable import BreakableGraph, capture_breakable
from graphcp.runtime.capture.buckets import FALLBACK_REQUESTS, BucketSet, Selection
from graphcp.runtime.capture.graphs import CaptureError, make_graph_backend
from graphcp.runtime.capture.selfcheck import failed_on_any_rank, first_difference, synthetic_batch
from graphcp.runtime.capture.static_buffers import BucketView, StaticBuffers
from graphcp.runtime.progress import progress_bar

#: eager runs before a capture (CUDA: lazy init, autotuning, allocator warm-up)
WARMUP_RUNS = {"cuda": 2, "trace": 1}


class ReplayInputError(RuntimeError):
    """Replay inputs differ from what the graph was captured with."""


@dataclass
class BucketCaptureStats:
    capacity: int
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


@dataclass(frozen=True)
class Fallback:
    """A batch the graphs do not take: it runs eagerly, for this reason (a FALLBACK_* key)."""

    reason: str


@dataclass
class _Captured:
    graph: BreakableGraph
    signature: dict  # name -> (shape, dtype, device, data_ptr) of the static views
    #: what the captured segments' collectives counted at capture (ForwardInfo.stats
    #: keys): a replay moves the same bytes without running Python, so it adds these
    segment_stats: dict = field(default_factory=dict)


def _signature(view: BucketView) -> dict:
    return {n: (tuple(t.shape), t.dtype, t.device, t.data_ptr()) for n, t in view.tensors().items()}


class GraphRunner:
    def __init__(self, body: Body, preparer: BatchPreparer, buckets: BucketSet, runtime: RuntimeConfig,
                 max_context: int) -> None:
        rt = runtime
        self.full = rt.graph == "full"
        if not self.full:  # tp experts into the breaks where a captured grouped matmul is not trusted yet
            body.model.hold_experts_out_of_graphs(body.device)
        # the layouts, caches and backends a full graph refuses were refused with the engine's
        # config (graphcp/combinations.py); what is left depends on the device, and is checked
        # after the experts moved: those in the eager break need no sync-free kernel
        problem = body.model.capture_problem(body.device, self.full)
        if problem is not None:
            raise ConfigError(problem)
        self.body, self.preparer, self.buckets = body, preparer, buckets
        self.max_context, self.max_requests = max_context, rt.max_requests
        cfg, kv = body.model.cfg, body.kv
        self.max_pages = -(-max_context // kv.page_size)
        #: the auxiliary hidden states every captured body copies out (this stage's
        #: share of RuntimeConfig.aux_hidden_layers): a graph knows which layers it copies
        self.aux_layers = tuple(i for i in rt.aux_hidden_layers if i in body.model.stage.layers)
        self.buffers = StaticBuffers(
            buckets.largest, body.group.size, body.model.attn_cfg.num_heads, cfg.head_dim, cfg.hidden_size,
            2 * rt.max_requests, self.max_pages, body.model.dtype, body.device, moe_rows=body.model.exchanges,
            hidden_in=body.takes_hidden, aux_layers=len(self.aux_layers),
            extra_rows=body.model.static_rows(), hidden_in_size=body.model.handoff_size,
            hidden_out_size=body.model.output_size,
        )
        self.backend = make_graph_backend(rt.graph_backend, body.device)
        self.graphs: dict[int, _Captured] = {}
        self.stats = RunnerStats()
        self.debug = rt.debug_graphs
        # on by default where it is cheap and the stand-in is what is being trusted
        self.verify = rt.verify_capture if rt.verify_capture is not None else self.backend.name == "trace"
        self._addresses = self.buffers.addresses()
        self._static_metas: dict[int, AttentionMetadata] = {}  # built once a bucket, not per replay
        self._checked: dict[int, BucketView] = {}  # views whose inputs were checked against the capture

    @property
    def model(self) -> DecoderModel:
        return self.body.model

    # ---- capture ----------------------------------------------------------------
    def _static_meta(self, view: BucketView) -> AttentionMetadata:
        """Metadata for capture. Breakable: an empty batch (the break reads live
        metadata at replay). Full graph: the static device buffers, whose host
        fields are static bounds (a captured kernel may size its grid by them)."""
        cached = self._static_metas.get(view.capacity)
        if cached is None:
            cached = self._static_metas[view.capacity] = self._build_static_meta(view)
        return cached

    def static_meta(self, capacity: int) -> AttentionMetadata:
        """The attention metadata bucket ``capacity`` is captured with (what a graph
        captured after the body's, an EAGLE-3 draft's, is captured and replayed with)."""
        return self._static_meta(self.buffers.view(capacity))

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

    def _aux(self, view: BucketView) -> AuxCapture | None:
        return AuxCapture(self.aux_layers, view.aux_out) if self.aux_layers else None

    def aux_rows(self, capacity: int) -> torch.Tensor | None:
        """The auxiliary hidden states the last replay of bucket ``capacity`` copied
        out: [capacity, len(aux_layers), hidden] (a static view), or None."""
        return self.buffers.view(capacity).aux_out

    def _fill_inert(self, capacity: int) -> BucketView:
        empty = np.zeros(0, dtype=np.int64)
        seg = (np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros((0, 1), np.int32)) if self.full else (None,) * 3
        return self.buffers.fill(capacity, empty, empty, empty, *seg)

    def capture_bucket(self, capacity: int) -> BucketCaptureStats:
        body = self.body
        with nvtx_range(f"capture[{capacity}]", category="capture"), torch.inference_mode():
            t0 = time.perf_counter()
            body.reserve(capacity)  # a replay's ring breaks then allocate nothing
            view = self._fill_inert(capacity)
            pool0 = self.backend.pool_bytes()
            with self.backend.capture_stream():
                ctx = body.context(None, view.kv_slots, view, meta=self._static_meta(view), stats={},
                                   aux=self._aux(view))

                def run() -> None:
                    view.hidden_out.copy_(body.run(ctx, view.input_ids, view.positions, view.hidden_in))

                for _ in range(WARMUP_RUNS.get(self.backend.name, 1)):
                    run()
                self.backend.synchronize()
                # the capture batch is inert: its breaks move nothing, so the KV bytes this
                # counts are the segments' (the replicated all-gather)
                ctx.stats.clear()
                graph = capture_breakable(self.backend, ctx, run, breakable=not self.full)
            self.backend.synchronize()
            graph.capacity = capacity
            self.graphs[capacity] = _Captured(graph, _signature(view), {KV_RECEIVED: ctx.stats.get(KV_RECEIVED, 0)})
            st = BucketCaptureStats(capacity, time.perf_counter() - t0, len(graph.segments), len(graph.breaks),
                                    graph.ops_per_segment, self.backend.pool_bytes() - pool0)
            if self.verify:
                t1 = time.perf_counter()
                st.verify_skipped = self.self_check(capacity)
                st.verify_s = time.perf_counter() - t1
            self.stats.captures.append(st)
            return st

    def capture_all(self, progress: bool = False, up_to: int | None = None) -> list[BucketCaptureStats]:
        """Capture the buckets not captured yet, largest first (``up_to``: only those of
        at most that many rows)."""
        caps = sorted((c for c in self.buckets.capacities if up_to is None or c <= up_to), reverse=True)
        out = []
        for cap in capture_progress(caps, progress and self.body.group.rank == 0):
            if cap not in self.graphs:
                out.append(self.capture_bucket(cap))
        return out

    @torch.inference_mode()
    def self_check(self, capacity: int) -> str | None:
        """Replay bucket ``capacity`` on a synthetic batch and compare its body rows
        and the KV pages it wrote, bitwise, with the same body run eagerly on the
        same bucket. Raises CaptureError (on every rank) on a difference; returns why
        it was skipped, or None. Leaves the KV pool as it found it."""
        body, kv, prep_ = self.body, self.body.kv, self.preparer
        spec = synthetic_batch(capacity, prep_.layout, kv.num_free_pages, kv.page_size, self.max_requests,
                               self.max_context)
        if spec is None:
            return f"the KV pool has {kv.num_free_pages} free pages"
        rng = np.random.default_rng(capacity)
        vocab = self.model.cfg.vocab_size
        # the same synthetic batch on every rank by construction: no consistency check
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
                rows = self.synthetic_input(prep, rng)
                pages = torch.tensor([p for s in prep.seq_ids for p in kv.handle(s).pages], device=body.device)
                pools = kv.page_pools()
                before = {n: p.index_select(1, pages) for n, p in pools.items()}
                got = {"hidden_out": self.replay(prep, capacity, hidden_in=rows).clone()}
                got.update({n: p.index_select(1, pages) for n, p in pools.items()})
                if self.aux_layers:
                    got["aux_hidden"] = self.aux_rows(capacity).clone()
                for n, p in pools.items():  # the eager body starts from the same cache
                    p.index_copy_(1, pages, before[n])
                want = {"hidden_out": self.eager_on_bucket(prep, capacity, rows), "aux_hidden": self.aux_rows(capacity)}
                want.update({n: p.index_select(1, pages) for n, p in pools.items()})
                problem = first_difference({n: (got[n], want[n]) for n in got})
            finally:
                prep_.abort(prep)
        finally:
            if prefix is not None:
                kv.release(prefix)
        if failed_on_any_rank(body.group, problem, body.device):
            raise CaptureError(
                f"rank {body.group.rank}: capture self-check of bucket {capacity}: the replay differs from the same "
                f"body run eagerly on a synthetic batch ({len(spec.extend_lens)} requests, {spec.num_tokens} tokens): "
                + (problem or "another rank's output differs")
            )
        return None

    def synthetic_input(self, prep: PreparedBatch, rng: np.random.Generator) -> torch.Tensor | None:
        """Seeded input rows for a later pipeline stage's body, to check its replay
        against its eager body without the earlier stages (None on the first)."""
        if not self.body.takes_hidden:
            return None
        n = prep.ids.shape[0]
        rows = torch.from_numpy(rng.standard_normal((n, self.model.handoff_size), dtype=np.float32))
        return rows.to(device=self.body.device, dtype=self.model.dtype)

    # ---- replay -----------------------------------------------------------------
    def select(self, required: int) -> Selection:
        return self.buckets.select(required)

    def fill(self, prep: PreparedBatch, capacity: int, hidden_in: torch.Tensor | None = None) -> BucketView:
        seg = (prep.meta.cu_seqlens_q_host, prep.meta.kv_lens_host, prep.seg_page_table) if self.full else (None,) * 3
        return self.buffers.fill(capacity, prep.ids, prep.positions, prep.slots, *seg, hidden_in=hidden_in)

    def _check(self, capacity: int, view: BucketView) -> None:
        # the same view object as last time means no buffer was replaced since that check
        if not self.debug and self._checked.get(capacity) is view:
            return
        want = self.graphs[capacity].signature
        got = _signature(view)
        for name, (shape, dtype, device, ptr) in want.items():
            g = got[name]
            if (shape, dtype, device) != g[:3]:
                raise ReplayInputError(
                    f"bucket {capacity}: static input {name} is {g[0]} {g[1]} on {g[2]}, captured as {shape} {dtype} "
                    f"on {device}"
                )
        if self.debug:
            now = self.buffers.addresses()
            moved = [n for n in now if now[n] != self._addresses[n]]
            moved += [n for n, (_, _, _, ptr) in want.items() if got[n][3] != ptr]
            if moved:
                raise ReplayInputError(f"bucket {capacity}: static buffers moved since capture: {sorted(set(moved))}")
        self._checked[capacity] = view

    def own_fallback(self, prep: PreparedBatch) -> str | None:
        """What rules this rank's batch out of the graphs whatever the rows it is padded
        to, or None: a full graph reads static segment metadata sized for max_requests."""
        if self.full and prep.meta.num_segments > self.buffers.max_segments:
            return FALLBACK_REQUESTS
        return None

    @torch.inference_mode()
    def try_replay(self, prep: PreparedBatch, hidden_in: torch.Tensor | None = None,
                   rows: int | None = None, fallback: str | None = None) -> tuple[torch.Tensor, ForwardInfo] | Fallback:
        """Replay the bucket for this batch (capturing it first if needed): the body's
        output rows and the forward's info; or the Fallback that says why it must run
        eagerly. ``hidden_in``: a later pipeline stage's input rows; ``rows``: the rows
        the bucket must hold (attention DP: the largest replica's, so every replica
        replays the same bucket; default this batch's); ``fallback``: a fallback the
        ranks agreed on (attention DP: one replica's :meth:`own_fallback` makes every
        replica run eagerly, so their collectives keep the same sizes)."""
        with nvtx_range("select", category="host"):
            sel = self.select(rows or prep.plan.max_local_rows)
            reason = fallback if fallback is not None else self.own_fallback(prep)
            if sel.graph and reason is not None:
                sel = Selection(sel.required, None, reason)
        if not sel.graph:
            self.stats.eager += 1
            self.stats.fallbacks[sel.reason] += 1
            return Fallback(sel.reason)
        cap = sel.capacity
        if cap not in self.graphs:
            self.capture_bucket(cap)
        timings: dict[str, float] = {}
        hidden = self.replay(prep, cap, timings, hidden_in)
        self.stats.replays += 1
        self.stats.replays_per_bucket[cap] += 1
        return hidden, ForwardInfo("graph", cap, sel.required, None, timings)

    @torch.inference_mode()
    def replay(self, prep: PreparedBatch, capacity: int, timings: dict | None = None,
               hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """Fill bucket ``capacity`` (captured already) with a prepared batch and replay
        its graph; the body's output rows (a static view). ``prep.stats`` receives the
        captured segments' counts plus what the breaks count."""
        t0 = time.perf_counter()
        with nvtx_range("fill", category="host"):
            view = self.fill(prep, capacity, hidden_in)
            self._check(capacity, view)
        t1 = time.perf_counter()
        with nvtx_range(f"replay[{capacity}]", category="graph"):
            meta = self._static_meta(view) if self.full else None
            captured = self.graphs[capacity]
            for key, value in captured.segment_stats.items():  # what the segments' collectives move
                prep.stats[key] = prep.stats.get(key, 0) + value
            ctx = self.body.context(prep, view.kv_slots, view, meta=meta, stats=prep.stats)
            captured.graph.replay(ctx)
        if timings is not None:
            timings.update(fill_s=t1 - t0, replay_s=time.perf_counter() - t1)
        return view.hidden_out

    @torch.inference_mode()
    def eager_on_bucket(self, prep: PreparedBatch, capacity: int,
                        hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """The same body on the same static buffers, run eagerly (no capture): a
        replay must equal this bitwise (and so must the auxiliary rows it copies)."""
        view = self.fill(prep, capacity, hidden_in)
        ctx = self.body.context(prep, view.kv_slots, view, aux=self._aux(view))
        return view.hidden_out.copy_(self.body.run(ctx, view.input_ids, view.positions, view.hidden_in))


def capture_progress(items, show: bool, desc: str = "capturing buckets"):
    """``items`` under a progress bar on stderr when ``show`` (where stderr is a terminal: runtime/progress.py)."""
    bar = progress_bar(show, items, desc=desc, unit="bucket")
    return items if bar is None else bar
