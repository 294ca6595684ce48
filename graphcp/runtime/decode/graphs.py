"""Decode graphs: the decode step's body captured once per batch-size bucket
(``RuntimeConfig.decode_buckets``, 1, 2, 4, ..., 64 by default) and page bucket,
attention and merge inside.

A bucket of ``n`` requests and ``w`` pages reads static buffers: the new tokens, their
positions and this rank's cache slots, and the attention's static metadata, each
request's length and page-table row (``kv_lens [n]``, ``page_table [n, w]``). A step of
``B <= n`` requests fills their first ``B`` rows; the rest are inert (token 0, slot -1:
the scratch page, length 0: output 0, LSE -inf, which a merge skips). ``w`` is the
smallest power of two (at most the cache's pages a request) that holds the step's
longest share of a request on this rank's pool, the same on every rank (the ledger's
largest): a step reads at most twice the pages its requests hold, whatever the pool. The
attention inside is :class:`~graphcp.attention.decode.paged.PagedDecodeAttention` (plain
torch operations over the static metadata), the merge's collectives have the bucket's
shapes, so the body is one captured segment; a layer that sizes work on the host (the MoE
``ep`` exchange) stays a break, run eagerly at replay over the same static buffers. A
step larger than every bucket runs eagerly and says so (``larger_than_every_bucket``).

Self-check (``RuntimeConfig.verify_capture``; on by default for the CPU stand-in, as for
the prefill graphs): the first replay of each bucket is checked against the same step run
eagerly on the same bucket, bitwise: the hidden rows and every page the step wrote. A
difference (a graph that kept something of its inert capture batch) is a CaptureError on
every rank, and the step changes nothing. The step is a real one: its requests' KV is
the cache's, so no synthetic batch is needed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from graphcp.attention.base import AttentionMetadata
from graphcp.attention.decode.paged import PagedDecodeAttention
from graphcp.attention.staging import PinnedStaging
from graphcp.model.forward_context import KV_RECEIVED, ForwardContext
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.capture.breakable import BreakableGraph, capture_breakable
from graphcp.runtime.capture.buckets import FALLBACK_TOO_LARGE
from graphcp.runtime.capture.graphs import CaptureError, make_graph_backend
from graphcp.runtime.capture.runner import WARMUP_RUNS, Fallback, capture_progress
from graphcp.runtime.capture.selfcheck import failed_on_any_rank, first_difference
from graphcp.runtime.decode.batch import PreparedStep
from graphcp.runtime.decode.step import StepBody

__all__ = ["DecodeGraphs", "Fallback"]


def captured_inside(name: str) -> bool:
    """False for the breaks a decode graph keeps: every one but plain attention (which a
    decode graph captures) sizes its work on the host."""
    return name != "attention"


@dataclass
class _Captured:
    graph: BreakableGraph
    ctx: ForwardContext  # the bucket's context: static metadata, slots and rows (its breaks read it)
    #: bytes the captured segments' collectives move a replay (counted at capture)
    segment_stats: dict
    plan: str  # the bucket's merge


def page_bucket(pages: int, most: int) -> int:
    """The smallest power of two >= ``pages`` (>= 1), at most ``most``."""
    return min(most, 1 << max(0, int(pages) - 1).bit_length())


class DecodeGraphs:
    """The decode graphs of one engine (see the module doc)."""

    def __init__(self, body: StepBody, buckets: tuple[int, ...], graph_backend: str,
                 verify: bool | None = None, staging: PinnedStaging | None = None) -> None:
        self.body, self.buckets = body, tuple(buckets)
        self.backend = make_graph_backend(graph_backend, body.device)
        #: check each bucket's first replay (module doc); None: on the CPU stand-in only
        self.verify = verify if verify is not None else self.backend.name == "trace"
        self.verified: set[tuple[int, int]] = set()  # (requests, pages) whose first replay was checked
        n, dev, kv = self.buckets[-1], body.device, body.kv
        self.width = kv.table_width
        i64 = dict(dtype=torch.int64, device=dev)
        self.ids, self.positions = torch.zeros(n, **i64), torch.zeros(n, **i64)
        self.slots = torch.full((n,), -1, **i64)
        self.kv_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.cu = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.page_table = torch.zeros((n, self.width), dtype=torch.int32, device=dev)
        self.hidden_out = torch.zeros(n, body.model.cfg.hidden_size, dtype=body.model.dtype, device=dev)
        # what fill writes on the host: pinned on CUDA, uploaded without blocking and fenced
        # (a fill waits until the previous fill's uploads ran before rewriting them), as the
        # prefill's static buffers are; plain memory on a CPU, copied in place
        self._staging = staging if staging is not None else PinnedStaging(dev) if dev.type == "cuda" else None
        host = self._staging.host if self._staging is not None else _plain_host
        self._rows_host = host(3 * n, torch.int64).view(3, n)  # ids, positions, slots
        self._lens_host = host(n, torch.int32)
        self._table_host = host(n * self.width, torch.int32)
        self.attention = PagedDecodeAttention(body.backend.spec)
        self.graphs: dict[tuple[int, int], _Captured] = {}  # (requests, pages) -> its graph
        self.replays: Counter = Counter()  # (requests, pages) -> replays
        self.fallbacks: Counter = Counter()  # reason -> eager steps

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket that holds ``rows`` requests (None: larger than every bucket)."""
        return next((b for b in self.buckets if b >= rows), None)

    def pages(self, step: PreparedStep) -> int:
        """The step's page bucket: its longest request share on any rank (every rank's the
        same: the ledger's largest; a replicated cache's, its own)."""
        kv = self.body.kv
        return page_bucket(kv.pages_for(kv.most_held(step.slots.rows)), self.width)

    def meta(self, capacity: int, width: int) -> AttentionMetadata:
        """The bucket's static metadata: one segment a row over its static length and pages."""
        ps = self.body.kv.page_size
        return AttentionMetadata(np.arange(capacity + 1, dtype=np.int32), np.zeros(capacity, dtype=np.int32),
                                 np.zeros((capacity, width), dtype=np.int32), ps, 1, width * ps,
                                 self.body.device, device_tensors=(self.cu[: capacity + 1], self.kv_lens[:capacity],
                                                                   self.page_table[:capacity, :width]))

    def fill(self, step: PreparedStep | None, capacity: int, width: int) -> None:
        """The step's rows into the bucket's static buffers, the rest inert (None: all inert)."""
        B = 0 if step is None else step.num_requests
        if self._staging is not None:
            self._staging.wait()  # the previous fill's uploads read these buffers when they run
        rows, lens = self._rows_host[:, :capacity].numpy(), self._lens_host[:capacity].numpy()
        table_host = self._table_host[: capacity * width].view(capacity, width)
        table = table_host.numpy()
        rows[:2], rows[2], lens[:], table[:] = 0, -1, 0, 0
        if step is not None:
            s = step.slots
            rows[:, :B] = step.tokens, s.positions, s.slots
            lens[:B] = s.local_lens
            self.body.kv.page_table_rows(s.rows, width, out=table[:B])
        for dst, src in ((self.ids, self._rows_host[0]), (self.positions, self._rows_host[1]),
                         (self.slots, self._rows_host[2]), (self.kv_lens, self._lens_host)):
            self._upload(dst[:capacity], src[:capacity])
        self._upload(self.page_table[:capacity, :width], table_host)
        if self._staging is not None:
            self._staging.mark()  # after every upload of this fill: the next fill waits for them

    def _upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._staging is None:
            dst.copy_(src)
        else:
            self._staging.upload(dst, src)

    def context(self, capacity: int, width: int, plan: str, live: int, stats: dict | None) -> ForwardContext:
        return self.body.context(self.meta(capacity, width), self.slots[:capacity], self.attention, plan, live,
                                 stats)

    def _runner(self, ctx: ForwardContext, capacity: int):
        ids, pos, out = self.ids[:capacity], self.positions[:capacity], self.hidden_out[:capacity]
        return lambda: out.copy_(self.body.run(ctx, ids, pos))

    @torch.inference_mode()
    def capture(self, capacity: int, width: int) -> _Captured:
        """Capture bucket ``(capacity, width)`` on an inert batch (its writes land in the scratch page)."""
        with nvtx_range(f"decode_capture[{capacity},{width}]", category="capture"):
            self.fill(None, capacity, width)
            plan = self.body.plan(capacity)
            ctx = self.context(capacity, width, plan, capacity, {})
            run = self._runner(ctx, capacity)
            with self.backend.capture_stream():
                for _ in range(WARMUP_RUNS.get(self.backend.name, 1)):
                    run()
                self.backend.synchronize()
                ctx.stats.clear()
                graph = capture_breakable(self.backend, ctx, run, breakable=captured_inside)
            self.backend.synchronize()
            total = ctx.stats.get(KV_RECEIVED, 0)
            ctx.stats = {}  # what the breaks move a replay (they run again): the rest is the segments'
            graph.replay(ctx)
            segments = {KV_RECEIVED: total - ctx.stats.get(KV_RECEIVED, 0)}
            self.graphs[capacity, width] = captured = _Captured(graph, ctx, segments, plan)
            return captured

    def capture_all(self, pages: int | None = None, progress: bool = False) -> list[int]:
        """Capture every batch-size bucket not captured yet for the page bucket that holds
        ``pages`` (None: the widest), largest first; the batch sizes captured."""
        width = self.width if pages is None else page_bucket(pages, self.width)
        todo = [b for b in sorted(self.buckets, reverse=True) if (b, width) not in self.graphs]
        for b in capture_progress(todo, progress, "capturing decode buckets"):
            self.capture(b, width)
        return todo

    @torch.inference_mode()
    def try_replay(self, step: PreparedStep, stats: dict) -> tuple[torch.Tensor, int, int] | Fallback:
        """Replay the step's bucket (capturing it first if needed): its hidden rows [B,
        hidden] (a static view), the bucket and the launches it took (segments and breaks);
        or the Fallback that says why it runs eagerly. ``stats`` receives the bytes moved
        and the page bucket (``pages``)."""
        B = step.num_requests
        capacity = self.bucket(B)
        if capacity is None:
            self.fallbacks[FALLBACK_TOO_LARGE] += 1
            return Fallback(FALLBACK_TOO_LARGE)
        width = self.pages(step)
        captured = self.graphs.get((capacity, width)) or self.capture(capacity, width)
        check = self.verify and (capacity, width) not in self.verified
        before = self._written(step) if check else None
        with nvtx_range(f"decode_replay[{capacity},{width}]", category="graph"):
            self.fill(step, capacity, width)
            stats.update(captured.segment_stats, decode_merge=captured.plan, pages=width)
            captured.ctx.stats, captured.ctx.inputs.live_rows = stats, B
            captured.graph.replay(captured.ctx)
        if check:
            self.self_check(step, capacity, width, before)
        self.replays[capacity, width] += 1
        return self.hidden_out[:B], capacity, len(captured.graph.segments) + len(captured.graph.breaks)

    def _written(self, step: PreparedStep) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The pages the step writes on this rank (its stored slots') and their contents now."""
        kv, slots = self.body.kv, step.slots.slots
        pages = torch.from_numpy(np.unique(slots[slots >= 0] // kv.page_size)).to(self.body.device)
        return pages, {n: p.index_select(1, pages) for n, p in kv.page_pools().items()}

    @torch.inference_mode()
    def self_check(self, step: PreparedStep, capacity: int, width: int,
                   before: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
        """After the first replay of bucket ``(capacity, width)``: the same step run eagerly
        on the same bucket from the same pages must give the same rows and pages, bitwise.
        Leaves the eager step's rows and pages (equal to the replay's) in place."""
        B, pools, (pages, saved) = step.num_requests, self.body.kv.page_pools(), before
        got = {"hidden_out": self.hidden_out[:B].clone(), **{n: p.index_select(1, pages) for n, p in pools.items()}}
        for n, p in pools.items():  # the eager step starts from the same cache
            p.index_copy_(1, pages, saved[n])
        want = {"hidden_out": self.eager_on_bucket(step, capacity)[:B],
                **{n: p.index_select(1, pages) for n, p in pools.items()}}
        problem = first_difference({n: (got[n], want[n]) for n in got})
        if failed_on_any_rank(self.body.group, problem, self.body.device):
            for n, p in pools.items():  # the pages as they were: the refused step leaves no trace
                p.index_copy_(1, pages, saved[n])
            raise CaptureError(f"rank {self.body.group.rank}: decode graph self-check of bucket {capacity} "
                               f"requests x {width} pages: the replay differs from the same step run eagerly on "
                               "the bucket: " + (problem or "another rank's output differs"))
        self.verified.add((capacity, width))

    @torch.inference_mode()
    def eager_on_bucket(self, step: PreparedStep, capacity: int) -> torch.Tensor:
        """The same body on the same static buffers, run eagerly (no capture): a replay of
        the bucket must equal this bitwise. Its hidden rows [capacity, hidden]."""
        width = self.pages(step)
        self.fill(step, capacity, width)
        ctx = self.context(capacity, width, self.body.plan(capacity), step.num_requests, {})
        self._runner(ctx, capacity)()
        return self.hidden_out[:capacity]


def _plain_host(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)
