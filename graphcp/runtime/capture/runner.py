"""GraphRunner: capture the body per (phase, bucket), replay it, or say why a batch runs eagerly.

What a bucket is in each phase, which one a prepared batch replays and what its graph
reads are the phase's (``phases.py``: a prefill's capacity of local rows, a decode step's
batch size and page width); the runner does the rest the same way for both:

- Capture: warm-up runs, then one :class:`BreakableGraph` per bucket on an inert batch
  (the prefill's buckets largest first, so later, smaller captures reuse the shared pool).
- Replay: select the bucket from the prepared batch, fill the static buffers, check the
  inputs against what was captured, build the forward's context (the host-side attention
  planning), replay.
- Self-check (``RuntimeConfig.verify_capture``): a replay is compared bitwise with the
  same forward run eagerly on the same bucket from the same pages, its rows and every
  page it wrote (:meth:`GraphRunner.check`); a difference is a CaptureError on every
  rank. The phase gives the input: a prefill bucket is checked at capture on a synthetic
  batch, a decode bucket on its first live replay.

The runner is built from the parts it uses (the body, the batch preparer for the
prefill's self-check, the buckets and the graph settings), never from the engine.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from graphcp.attention.phase import DECODE, PREFILL, Phase
from graphcp.config import RuntimeConfig
from graphcp.errors import ConfigError
from graphcp.model.forward_context import KV_RECEIVED
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.batch import BatchPreparer, ForwardInfo, PreparedBatch
from graphcp.runtime.body import Body
from graphcp.runtime.capture.breakable import BreakableGraph, capture_breakable
from graphcp.runtime.capture.buckets import BucketSet, Selection
from graphcp.runtime.capture.graphs import CaptureError, make_graph_backend
from graphcp.runtime.capture.phases import BucketCaptureStats, DecodeGraphs, PhaseGraphs, PrefillGraphs
from graphcp.runtime.capture.selfcheck import failed_on_any_rank, first_difference
from graphcp.runtime.progress import progress_bar

#: eager runs before a capture (CUDA: lazy init, autotuning, allocator warm-up)
WARMUP_RUNS = {"cuda": 2, "trace": 1}


class ReplayInputError(RuntimeError):
    """Replay inputs differ from what the graph was captured with."""


@dataclass(frozen=True)
class Fallback:
    """A batch the graphs do not take: it runs eagerly, for this reason (a FALLBACK_* key)."""

    reason: str


@dataclass
class _Captured:
    graph: BreakableGraph
    signature: dict  # name -> (shape, dtype, device, data_ptr) of the static views
    #: what a replay adds to its forward's figures (ForwardInfo.stats): the bytes the
    #: captured segments' collectives moved at capture (a replay moves the same without
    #: running Python; its breaks count theirs as they run), a decode bucket's page width
    stats: dict = field(default_factory=dict)


def _signature(view) -> dict:
    return {n: (tuple(t.shape), t.dtype, t.device, t.data_ptr()) for n, t in view.tensors().items()}


class GraphRunner:
    def __init__(self, body: Body, preparer: BatchPreparer, buckets: BucketSet, runtime: RuntimeConfig,
                 max_context: int) -> None:
        rt = runtime
        full = rt.graph == "full"
        if not full:  # tp experts into the breaks where a captured grouped matmul is not trusted yet
            body.model.hold_experts_out_of_graphs(body.device)
        # the layouts, caches and backends a full graph refuses were refused with the engine's
        # config (graphcp/combinations.py); what is left depends on the device, and is checked
        # after the experts moved: those in the eager break need no sync-free kernel
        problem = body.model.capture_problem(body.device, full)
        if problem is not None:
            raise ConfigError(problem)
        self.body, self.runtime = body, rt
        self.backend = make_graph_backend(rt.graph_backend, body.device)
        self.debug = rt.debug_graphs
        # on by default where it is cheap and the stand-in is what is being trusted
        self.verify = rt.verify_capture if rt.verify_capture is not None else self.backend.name == "trace"
        #: the prefill's graphs (by capacity: what the tools read through graphs, buffers, stats)
        self.prefill = PrefillGraphs(body, preparer, buckets, rt, max_context)
        self.phases: dict[Phase, PhaseGraphs] = {PREFILL: self.prefill}
        self._addresses = {PREFILL: self.prefill.buffers.addresses()}

    graphs = property(lambda self: self.prefill.graphs, doc="The prefill's captured graphs by capacity.")
    buffers = property(lambda self: self.prefill.buffers, doc="The prefill's static buffers.")
    stats = property(lambda self: self.prefill.stats, doc="The prefill's replays, fallbacks and captures.")
    aux_layers = property(lambda self: self.prefill.aux_layers, doc="The auxiliary layers a prefill graph copies.")

    def phase(self, phase: Phase) -> PhaseGraphs:
        """``phase``'s graphs; a decode step's made on first use (an engine that never
        decodes, or whose model decode refuses, builds none)."""
        got = self.phases.get(phase)
        if got is None and phase == DECODE:
            got = self.phases[phase] = DecodeGraphs(self.body, self.runtime.decode_buckets,
                                                    aux_layers=self.prefill.aux_layers)
            self._addresses[phase] = got.buffers.addresses()
        return got

    def select(self, required: int) -> Selection:
        """The prefill bucket of ``required`` local rows (or why none)."""
        return self.prefill.buckets.select(required)

    def aux_rows(self, capacity: int) -> torch.Tensor | None:
        """The auxiliary hidden states the last replay of prefill bucket ``capacity`` copied out."""
        return self.prefill.aux_rows(capacity)

    # ---- capture ----------------------------------------------------------------
    def capture_bucket(self, key: Hashable, phase: Phase = PREFILL) -> BucketCaptureStats:
        """Capture bucket ``key`` of ``phase`` (a prefill's capacity; a decode step's
        ``(requests, pages)``) on an inert batch; a prefill bucket is then self-checked."""
        ph, body, backend = self.phase(phase), self.body, self.backend
        with nvtx_range(ph.range_name("capture", key), category="capture"), torch.inference_mode():
            t0 = time.perf_counter()
            ph.reserve(key)
            view = ph.fill(None, key)
            pool0 = backend.pool_bytes()
            with backend.capture_stream():
                ctx = ph.context(None, key, view, stats={}, aux=ph.aux(view))

                def run() -> None:
                    view.hidden_out.copy_(body.run(ctx, view.input_ids, view.positions, view.hidden_in))

                for _ in range(WARMUP_RUNS.get(backend.name, 1)):
                    run()
                backend.synchronize()
                ctx.stats.clear()
                graph = capture_breakable(backend, ctx, run, breakable=ph.breakable)
            backend.synchronize()
            graph.capacity = ph.rows(key)
            # the bytes the segments moved: what the capture counted, less its breaks'
            moved = ctx.stats.get(KV_RECEIVED, 0) - graph.break_stats.get(KV_RECEIVED, 0)
            ph.graphs[key] = _Captured(graph, _signature(view), {KV_RECEIVED: moved, **ph.bucket_stats(key)})
            st = BucketCaptureStats(ph.rows(key), time.perf_counter() - t0, len(graph.segments), len(graph.breaks),
                                    graph.ops_per_segment, backend.pool_bytes() - pool0)
            if self.verify and ph.check_at == "capture":
                t1 = time.perf_counter()
                st.verify_skipped = self.self_check(key)
                st.verify_s = time.perf_counter() - t1
            ph.stats.captures.append(st)
            return st

    def capture_all(self, progress: bool = False, up_to: int | None = None) -> list[BucketCaptureStats]:
        """Capture the prefill buckets not captured yet, largest first (``up_to``: only
        those of at most that many rows)."""
        return self.capture_keys(PREFILL, self.prefill.capture_order(up_to), progress)

    def capture_keys(self, phase: Phase, keys: Sequence[Hashable], progress: bool = False,
                     desc: str = "capturing buckets") -> list[BucketCaptureStats]:
        """Capture the buckets ``keys`` of ``phase`` not captured yet, in order."""
        ph = self.phase(phase)
        out = []
        for key in capture_progress(keys, progress and self.body.group.rank == 0, desc):
            if key not in ph.graphs:
                out.append(self.capture_bucket(key, phase))
        return out

    # ---- the self-check ----------------------------------------------------------
    @torch.inference_mode()
    def self_check(self, capacity: int) -> str | None:
        """The prefill's self-check of bucket ``capacity``: :meth:`check` on a synthetic
        batch (graphcp.runtime.capture.selfcheck), given back after. Raises CaptureError
        (on every rank) on a difference; returns why it was skipped, or None."""
        ph = self.prefill
        spec = ph.synthetic_spec(capacity)
        if spec is None:
            return f"the KV pool has {self.body.kv.num_free_pages} free pages"
        with ph.synthetic(capacity, spec) as (prep, rows):
            self.check(prep, capacity, rows, f"capture self-check of bucket {capacity}: the replay differs from the "
                       f"same body run eagerly on a synthetic batch ({len(spec.extend_lens)} requests, "
                       f"{spec.num_tokens} tokens)")
        ph.verified.add(capacity)
        return None

    @torch.inference_mode()
    def check(self, prep: PreparedBatch, key: Hashable, hidden_in: torch.Tensor | None, what: str,
              timings: dict | None = None) -> torch.Tensor:
        """Replay bucket ``key`` on ``prep``, then run the same forward eagerly on the same
        bucket from the same pages: its rows, the pages it wrote (and the per-request state
        slots, PhaseGraphs.written_states) and the phase's other static outputs must equal
        the replay's bitwise. Any rank's difference is a CaptureError on every rank
        (``what``: which check, and of what), the pages and slots put back as they were;
        otherwise the eager forward's rows and pages (the replay's) stay, and its rows are
        returned."""
        ph, kv = self.phases[prep.phase], self.body.kv
        # what the forward writes: pages of the page pools (and a storage's state slots),
        # each pool's entries along dim 1
        written = [(kv.page_pools(), ph.written_pages(prep))]
        slots = ph.written_states(prep)
        if slots is not None:
            written.append((kv.state_pools(), slots))
        before = [_read(pools, at) for pools, at in written]
        got = {"hidden_out": self._replay(ph, prep, key, timings, hidden_in).clone()}
        for pools, at in written:
            got.update(_read(pools, at))
        got.update({n: t.clone() for n, t in ph.compared(key).items()})
        _restore(written, before)  # the eager forward starts from the same cache
        want = {"hidden_out": self._eager_on_bucket(ph, prep, key, hidden_in), **ph.compared(key)}
        for pools, at in written:
            want.update(_read(pools, at))
        problem = first_difference({n: (got[n], want[n]) for n in got})
        group = self.body.group
        if failed_on_any_rank(group, problem, self.body.device):
            _restore(written, before)  # the refused forward leaves no trace
            raise CaptureError(f"rank {group.rank}: {what}: " + (problem or "another rank's output differs"))
        return want["hidden_out"]

    # ---- replay -----------------------------------------------------------------
    def _check_inputs(self, ph: PhaseGraphs, key: Hashable, view) -> None:
        # the same view object as last time means no buffer was replaced since that check
        if not self.debug and ph.checked.get(key) is view:
            return
        want = ph.graphs[key].signature
        got = _signature(view)
        for name, (shape, dtype, device, ptr) in want.items():
            g = got[name]
            if (shape, dtype, device) != g[:3]:
                raise ReplayInputError(
                    f"bucket {key}: static input {name} is {g[0]} {g[1]} on {g[2]}, captured as {shape} {dtype} "
                    f"on {device}"
                )
        if self.debug:
            now, then = ph.buffers.addresses(), self._addresses[ph.phase]
            moved = [n for n in now if now[n] != then[n]]
            moved += [n for n, (_, _, _, ptr) in want.items() if got[n][3] != ptr]
            if moved:
                raise ReplayInputError(f"bucket {key}: static buffers moved since capture: {sorted(set(moved))}")
        ph.checked[key] = view

    def fill(self, prep: PreparedBatch, capacity: int, hidden_in: torch.Tensor | None = None):
        """``prep``'s rows into its phase's bucket of ``capacity`` rows; the static views."""
        ph = self.phases[prep.phase]
        return ph.fill(prep, ph.key(prep, capacity), hidden_in)

    @torch.inference_mode()
    def try_replay(self, prep: PreparedBatch, hidden_in: torch.Tensor | None = None,
                   rows: int | None = None, fallback: str | None = None) -> tuple[torch.Tensor, ForwardInfo] | Fallback:
        """Replay the bucket for this batch, of its phase (capturing it first if needed):
        the body's output rows and the forward's info; or the Fallback that says why it
        must run eagerly. ``hidden_in``: a later pipeline stage's input rows; ``rows`` and
        ``fallback``: what the ranks agreed on (attention DP: PrefillGraphs.select)."""
        ph = self.phases.get(prep.phase) or self.phase(prep.phase)
        with nvtx_range("select", category="host"):
            sel = ph.select(prep, rows, fallback)
        if not sel.graph:
            ph.stats.eager += 1
            ph.stats.fallbacks[sel.reason] += 1
            return Fallback(sel.reason)
        key = ph.key(prep, sel.capacity)
        if key not in ph.graphs:
            self.capture_bucket(key, prep.phase)
        timings: dict[str, float] = {}
        if self.verify and ph.check_at == "first_replay" and key not in ph.verified:
            hidden = self.check(prep, key, hidden_in, ph.check_name(key), timings)
            ph.verified.add(key)
        else:
            hidden = self._replay(ph, prep, key, timings, hidden_in)
        ph.stats.replays += 1
        ph.stats.replays_per_bucket[key] += 1
        graph = ph.graphs[key].graph
        return hidden, ForwardInfo("graph", sel.capacity, sel.required, None, timings, phase=prep.phase,
                                   launches=len(graph.segments) + len(graph.breaks))

    @torch.inference_mode()
    def replay(self, prep: PreparedBatch, capacity: int, timings: dict | None = None,
               hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """Fill ``prep``'s bucket of ``capacity`` rows (captured already) and replay its
        graph; the body's output rows (a static view). ``prep.stats`` receives the
        captured segments' counts plus what the breaks count."""
        ph = self.phases[prep.phase]
        return self._replay(ph, prep, ph.key(prep, capacity), timings, hidden_in)

    def _replay(self, ph: PhaseGraphs, prep: PreparedBatch, key: Hashable, timings: dict | None = None,
                hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        with nvtx_range("fill", category="host"):
            view = ph.fill(prep, key, hidden_in)
            self._check_inputs(ph, key, view)
        t1 = time.perf_counter()
        with nvtx_range(ph.range_name("replay", key), category="graph"):
            captured = ph.graphs[key]
            prep.stats.update(captured.stats)  # (the forward's first figures: its breaks add theirs)
            ctx = ph.context(prep, key, view, stats=prep.stats)
            captured.graph.replay(ctx)
        if timings is not None:
            timings.update(fill_s=t1 - t0, replay_s=time.perf_counter() - t1)
        return ph.output(view, prep)

    @torch.inference_mode()
    def eager_on_bucket(self, prep: PreparedBatch, capacity: int,
                        hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """The same body on the same static buffers, run eagerly (no capture): a
        replay must equal this bitwise (and so must the auxiliary rows it copies)."""
        ph = self.phases[prep.phase]
        return self._eager_on_bucket(ph, prep, ph.key(prep, capacity), hidden_in)

    def _eager_on_bucket(self, ph: PhaseGraphs, prep: PreparedBatch, key: Hashable,
                         hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        view = ph.fill(prep, key, hidden_in)
        ctx = ph.context(prep, key, view, aux=ph.aux(view), eager=True)
        view.hidden_out.copy_(self.body.run(ctx, view.input_ids, view.positions, view.hidden_in))
        return ph.output(view, prep)


def _read(pools: dict[str, torch.Tensor], at: torch.Tensor) -> dict[str, torch.Tensor]:
    return {n: p.index_select(1, at) for n, p in pools.items()}


def _restore(written: list[tuple[dict[str, torch.Tensor], torch.Tensor]], saved: list[dict[str, torch.Tensor]]) -> None:
    for (pools, at), values in zip(written, saved):
        for n, p in pools.items():
            p.index_copy_(1, at, values[n])


def capture_progress(items, show: bool, desc: str = "capturing buckets"):
    """``items`` under a progress bar on stderr when ``show`` (where stderr is a terminal: runtime/progress.py)."""
    bar = progress_bar(show, items, desc=desc, unit="bucket")
    return items if bar is None else bar

