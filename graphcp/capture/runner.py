"""GraphRunner: capture the body per bucket, replay it, fall back to eager.

Capture: largest bucket first (so later, smaller captures reuse the shared
pool), warm-up runs before each capture, one :class:`BreakableGraph` per bucket.
Replay: select the bucket from the plan, fill the static buffers, check the
inputs against what was captured, run the host-side attention planning, replay.
Self-check (``RuntimeConfig.verify_capture``): each new bucket is replayed once on
a synthetic batch and compared bitwise with the same-bucket eager body.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from graphcp.attention.base import AttentionMetadata
from graphcp.buffers.static import BucketView, StaticBuffers
from graphcp.capture.breakable import BreakableGraph, capture_breakable
from graphcp.capture.buckets import FALLBACK_REQUESTS, BucketSet, Selection
from graphcp.capture.graphs import CaptureError, make_graph_backend
from graphcp.capture.selfcheck import first_difference, synthetic_batch
from graphcp.config import ConfigError
from graphcp.profiling import nvtx_range

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


@dataclass
class _Captured:
    graph: BreakableGraph
    signature: dict  # name -> (shape, dtype, device, data_ptr) of the static views


def _signature(view: BucketView) -> dict:
    return {n: (tuple(t.shape), t.dtype, t.device, t.data_ptr()) for n, t in view.tensors().items()}


class GraphRunner:
    def __init__(self, engine, buckets: BucketSet) -> None:
        rt = engine.runtime
        if rt.layout != "zigzag":
            raise ConfigError(f"the graph path runs the zigzag layout only, got layout={rt.layout!r}; use --graph off")
        if engine.parallel.pp_size != 1 or engine.parallel.tp_size != engine.parallel.cp_size:
            raise ConfigError("the graph path needs PP = 1 and CP = TP")
        self.full = rt.graph == "full"
        if self.full and not engine.attention.supports_full_graph:
            raise ConfigError(
                f"--graph full needs an attention backend with static-capacity support; "
                f"{engine.attention.name!r} has none (use --graph breakable, or --attention triton)"
            )
        self.engine, self.buckets = engine, buckets
        cfg = engine.cfg
        self.max_pages = -(-engine.max_context // engine.kv.page_size)
        self.buffers = StaticBuffers(
            buckets.largest, engine.group.size, cfg.num_heads, cfg.head_dim, cfg.hidden_size,
            2 * rt.max_requests, self.max_pages, engine.dtype, engine.device,
        )
        self.backend = make_graph_backend(rt.graph_backend, engine.device)
        self.graphs: dict[int, _Captured] = {}
        self.stats = RunnerStats()
        self.last_fallback: str | None = None
        self.debug = rt.debug_graphs
        # on by default where it is cheap and the stand-in is what is being trusted
        self.verify = rt.verify_capture if rt.verify_capture is not None else self.backend.name == "trace"
        self._addresses = self.buffers.addresses()
        self._static_metas: dict[int, AttentionMetadata] = {}  # built once a bucket, not per replay
        self._checked: dict[int, BucketView] = {}  # views whose inputs were checked against the capture

    # ---- capture ----------------------------------------------------------------
    def _static_meta(self, view: BucketView) -> AttentionMetadata:
        """Metadata for capture. Breakable: an empty batch (the break reads live
        metadata at replay). Full graph: the static device buffers, whose host
        fields are static bounds (a captured kernel may size its grid by them)."""
        cached = self._static_metas.get(view.capacity)
        if cached is not None:
            return cached
        meta = self._build_static_meta(view)
        self._static_metas[view.capacity] = meta
        return meta

    def _build_static_meta(self, view: BucketView) -> AttentionMetadata:
        S = self.buffers.max_segments
        if not self.full:
            return AttentionMetadata.from_host(np.zeros(1), np.zeros(0), np.zeros((0, 1)), self.engine.kv.page_size,
                                               self.engine.device)
        return AttentionMetadata(
            cu_seqlens_q_host=np.zeros(S + 1, dtype=np.int32), kv_lens_host=np.zeros(S, dtype=np.int32),
            page_table_host=np.zeros((S, self.max_pages), dtype=np.int32), page_size=self.engine.kv.page_size,
            max_q_len=view.capacity, max_kv_len=self.max_pages * self.engine.kv.page_size,
            device=self.engine.device, device_tensors=(view.cu_seqlens_q, view.kv_lens, view.page_table),
        )

    def _fill_inert(self, capacity: int) -> BucketView:
        empty = np.zeros(0, dtype=np.int64)
        seg = (np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros((0, 1), np.int32)) if self.full else (None,) * 3
        return self.buffers.fill(capacity, empty, empty, empty, *seg)

    def capture_bucket(self, capacity: int) -> BucketCaptureStats:
        eng = self.engine
        with nvtx_range(f"capture[{capacity}]", category="capture"), torch.inference_mode():
            t0 = time.perf_counter()
            view = self._fill_inert(capacity)
            meta = self._static_meta(view)
            ctx = eng.make_context(meta, view.kv_slots, view)

            def body() -> None:
                view.hidden_out.copy_(eng.model.body(view.input_ids, view.positions, ctx))

            pool0 = self.backend.pool_bytes()
            with self.backend.capture_stream():
                eng.attention.prepare(meta)
                for _ in range(WARMUP_RUNS.get(self.backend.name, 1)):
                    body()
                self.backend.synchronize()
                graph = capture_breakable(self.backend, ctx, body, breakable=not self.full)
            self.backend.synchronize()
            graph.capacity = capacity
            self.graphs[capacity] = _Captured(graph, _signature(view))
            st = BucketCaptureStats(capacity, time.perf_counter() - t0, len(graph.segments), len(graph.breaks),
                                    graph.ops_per_segment, self.backend.pool_bytes() - pool0)
            if self.verify:
                t1 = time.perf_counter()
                st.verify_skipped = self.self_check(capacity)
                st.verify_s = time.perf_counter() - t1
            self.stats.captures.append(st)
            return st

    def self_check(self, capacity: int) -> str | None:
        """Replay bucket ``capacity`` on a synthetic batch and compare its body rows
        and the KV pages it wrote, bitwise, with the same body run eagerly on the
        same bucket. Raises CaptureError (on every rank) on a difference; returns why
        it was skipped, or None. Leaves the KV pool as it found it."""
        from graphcp.engine import Request  # the batch types live with the engine (for now)

        eng, kv = self.engine, self.engine.kv
        spec = synthetic_batch(capacity, eng.layout, kv.num_free_pages, kv.page_size,
                               eng.runtime.max_requests, eng.max_context)
        if spec is None:
            return f"the KV pool has {kv.num_free_pages} free pages"
        rng = np.random.default_rng(capacity)
        vocab = eng.cfg.vocab_size
        prefix = None
        if spec.prefix_len:
            prefix = eng.prefill([Request(rng.integers(0, vocab, spec.prefix_len))], force_eager=True).handles[0]
        try:
            prep = eng.prepare_batch([Request(rng.integers(0, vocab, n), prefix if j == 0 else None)
                                      for j, n in enumerate(spec.extend_lens)])
            try:
                pages = torch.tensor([p for s in prep.seq_ids for p in kv.handle(s).pages], device=eng.device)
                before = kv.pool.index_select(1, pages)
                got = self.replay(prep, capacity).clone(), kv.pool.index_select(1, pages)
                kv.pool.index_copy_(1, pages, before)  # the eager body starts from the same cache
                want = self.eager_on_bucket(prep, capacity), kv.pool.index_select(1, pages)
                problem = first_difference({"hidden_out": (got[0], want[0]), "kv_cache": (got[1], want[1])})
            finally:
                eng.abort(prep)
        finally:
            if prefix is not None:
                eng.release(prefix)
        # every rank raises, so none is left waiting in a collective
        failed = torch.tensor([problem is not None], dtype=torch.int64, device=eng.device)
        eng.group.all_reduce_(failed, "max")
        if failed.item():
            raise CaptureError(
                f"rank {eng.rank}: capture self-check of bucket {capacity}: the replay differs from the same "
                f"body run eagerly on a synthetic batch ({len(spec.extend_lens)} requests, {spec.num_tokens} tokens): "
                + (problem or "another rank's output differs")
            )
        return None

    def capture_all(self, progress: bool = False) -> list[BucketCaptureStats]:
        caps = sorted(self.buckets.capacities, reverse=True)
        out = []
        bar = _progress(caps, progress and self.engine.rank == 0)
        for cap in bar:
            if cap not in self.graphs:
                out.append(self.capture_bucket(cap))
        return out

    # ---- replay -----------------------------------------------------------------
    def select(self, required: int):
        return self.buckets.select(required)

    def fill(self, prep, capacity: int) -> BucketView:
        seg = (prep.meta.cu_seqlens_q_host, prep.meta.kv_lens_host, prep.seg_page_table) if self.full else (None,) * 3
        return self.buffers.fill(capacity, prep.ids, prep.positions, prep.slots, *seg)

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

    @torch.inference_mode()
    def try_replay(self, prep):
        """Replay the bucket for this batch, or None (and the reason in
        ``last_fallback``) when it must run eagerly."""
        from graphcp.engine import ForwardInfo  # engine imports the runner lazily; no cycle at import time

        with nvtx_range("select", category="host"):
            sel = self.select(prep.plan.max_local_rows)
            if sel.graph and self.full and prep.meta.num_segments > self.buffers.max_segments:
                # a full graph reads static segment metadata sized for max_requests
                sel = Selection(sel.required, None, FALLBACK_REQUESTS)
        if not sel.graph:
            self.last_fallback = sel.reason
            self.stats.eager += 1
            self.stats.fallbacks[sel.reason] += 1
            return None
        cap = sel.capacity
        if cap not in self.graphs:
            self.capture_bucket(cap)
        timings: dict[str, float] = {}
        hidden = self.replay(prep, cap, timings)
        self.stats.replays += 1
        self.stats.replays_per_bucket[cap] += 1
        self.last_fallback = None
        return hidden, ForwardInfo("graph", cap, sel.required, None, timings)

    @torch.inference_mode()
    def replay(self, prep, capacity: int, timings: dict | None = None) -> torch.Tensor:
        """Fill bucket ``capacity`` with a prepared batch and replay its graph; the
        body's output rows (a static view)."""
        t0 = time.perf_counter()
        with nvtx_range("fill", category="host"):
            view = self.fill(prep, capacity)
            self._check(capacity, view)
        t1 = time.perf_counter()
        ctx = self.engine.make_context(prep.meta if not self.full else self._static_meta(view), view.kv_slots, view)
        with nvtx_range(f"replay[{capacity}]", category="graph"):
            self.engine.attention.prepare(prep.meta)
            self.graphs[capacity].graph.replay(ctx)
        if timings is not None:
            timings.update(fill_s=t1 - t0, replay_s=time.perf_counter() - t1)
        return view.hidden_out

    @torch.inference_mode()
    def eager_on_bucket(self, prep, capacity: int) -> torch.Tensor:
        """The same body on the same static buffers, run eagerly (no capture): a
        replay must equal this bitwise."""
        view = self.fill(prep, capacity)
        ctx = self.engine.make_context(prep.meta, view.kv_slots, view)
        self.engine.attention.prepare(prep.meta)
        view.hidden_out.copy_(self.engine.model.body(view.input_ids, view.positions, ctx))
        return view.hidden_out


def _progress(items, show: bool):
    if not show:
        return items
    try:
        from tqdm import tqdm

        return tqdm(items, desc="capturing buckets", unit="bucket", file=sys.stderr)
    except ImportError:
        return items
