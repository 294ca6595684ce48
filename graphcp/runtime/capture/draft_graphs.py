"""An EAGLE-3 draft's graphs (``RuntimeConfig.draft`` with graphs): per bucket, the
draft's forward captured after the target's, as the target is: breakable, its layer's
computation the segments and its attention a break; full, its attention inside, on the
target's static metadata of the bucket. It reads the target's static views of the same
bucket (positions, cache slots, the auxiliary rows the target's replay copied out,
attn_q / attn_out) and its own static input ids. A replay equals, bitwise, the
same draft run eagerly on the same static buffers (:meth:`DraftGraphs.eager_on_bucket`).
The target's replay of the bucket must come first: it fills what the draft reads."""

from __future__ import annotations

import numpy as np
import torch

from graphcp.attention.staging import to_device
from graphcp.model.eagle3.layer import Eagle3Draft
from graphcp.model.forward_context import KV_RECEIVED, ForwardContext
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.batch import PreparedBatch
from graphcp.runtime.capture.breakable import BreakableGraph, capture_breakable
from graphcp.runtime.capture.runner import GraphRunner


class DraftGraphs:
    def __init__(self, draft: Eagle3Draft, runner: GraphRunner) -> None:
        self.draft, self.runner = draft, runner
        body, bufs = runner.body, runner.buffers
        dev, h = body.device, draft.cfg.hidden_size
        #: the draft's columns of the target's auxiliary rows, in the checkpoint's order
        self.cols = torch.tensor([runner.aux_layers.index(i) for i in draft.aux_layer_ids], device=dev)
        self.ids = torch.zeros(bufs.max_capacity, dtype=torch.int64, device=dev)
        self.normed = torch.zeros(bufs.max_capacity, h, dtype=draft.dtype, device=dev)
        self.pre = torch.zeros(bufs.max_capacity, h, dtype=draft.dtype, device=dev)
        self.graphs: dict[int, tuple[BreakableGraph, int]] = {}  # capacity -> (graph, its segments' KV bytes)

    def _run(self, ctx: ForwardContext, capacity: int) -> None:
        view = self.runner.buffers.view(capacity)
        hidden = view.aux_out.index_select(1, self.cols).flatten(1)  # fc's input: this rank's rows
        normed, pre = self.draft(self.ids[:capacity], view.positions, hidden, ctx)
        self.normed[:capacity].copy_(normed)
        self.pre[:capacity].copy_(pre)

    def capture(self, capacity: int) -> None:
        """Capture bucket ``capacity``'s draft graph (once)."""
        if capacity in self.graphs:
            return
        runner, body = self.runner, self.runner.body
        view = runner.buffers.view(capacity)
        with nvtx_range(f"capture_draft[{capacity}]", category="capture"), torch.inference_mode():
            # inert rows (token 0, position 0, the scratch slot); the target's live rows
            # (a capture on first use follows its replay) are put back after
            live = view.positions.clone(), view.kv_slots.clone()
            self.ids[:capacity].zero_()
            view.positions.zero_()
            view.kv_slots.fill_(-1)
            with runner.backend.capture_stream():
                ctx = body.context(None, view.kv_slots, view, meta=runner.prefill.static_meta(capacity), stats={})
                self._run(ctx, capacity)  # warm-up
                runner.backend.synchronize()
                ctx.stats.clear()
                # a full graph captures the attention too (its static metadata: the target's bucket's)
                graph = capture_breakable(runner.backend, ctx, lambda: self._run(ctx, capacity),
                                          breakable=not runner.prefill.full)
            runner.backend.synchronize()
            view.positions.copy_(live[0])
            view.kv_slots.copy_(live[1])
        self.graphs[capacity] = (graph, ctx.stats.get(KV_RECEIVED, 0))

    def _fill(self, capacity: int, ids: np.ndarray) -> None:
        rows = np.zeros(capacity, dtype=np.int64)  # padding rows read token 0
        rows[:ids.shape[0]] = ids
        self.ids[:capacity].copy_(to_device(rows, self.ids.device))  # uploaded without blocking, then in place

    @torch.inference_mode()
    def replay(self, prep: PreparedBatch, capacity: int, ids: np.ndarray,
               stats: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over the batch the target's graph of bucket ``capacity`` just
        replayed (``ids``: this rank's draft input ids): its normed and pre-norm rows
        (static views). ``stats`` gets the K/V bytes its exchange received."""
        self.capture(capacity)
        graph, segment_bytes = self.graphs[capacity]
        self._fill(capacity, ids)
        view = self.runner.buffers.view(capacity)
        stats[KV_RECEIVED] = stats.get(KV_RECEIVED, 0) + segment_bytes
        with nvtx_range(f"replay_draft[{capacity}]", category="graph"):
            meta = self.runner.prefill.static_meta(capacity) if self.runner.prefill.full else None
            ctx = self.runner.body.context(prep, view.kv_slots, view, meta=meta, stats=stats)
            graph.replay(ctx)
        return self.normed[:capacity], self.pre[:capacity]

    @torch.inference_mode()
    def eager_on_bucket(self, prep: PreparedBatch, capacity: int, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The same draft on the same static buffers, run eagerly (no capture): a replay
        must equal this bitwise."""
        self._fill(capacity, ids)
        view = self.runner.buffers.view(capacity)
        ctx = self.runner.body.context(prep, view.kv_slots, view)
        self._run(ctx, capacity)
        return self.normed[:capacity], self.pre[:capacity]
