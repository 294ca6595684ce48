"""A decode step's forward on this rank: every rank runs every request's new row through
its stage's layers (the rows are the same on every rank), each layer storing and
attending through the exchange's decode step (graphcp.attention.decode.steps); the FFN
all-reduces its partial sums over the stage (graphcp.model.communicator.ReplicatedRows).
Eagerly here, on the engine's attention backend over the step's live metadata; the
decode graphs (``graphs``) run the same body over static buffers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphcp.attention.base import AttentionMetadata
from graphcp.attention.kv_exchange import KVExchange, KVForward
from graphcp.attention.phase import DECODE
from graphcp.dist import CPGroup
from graphcp.kv.paged import PagedKVCache
from graphcp.model.communicator import ReplicatedRows
from graphcp.model.forward_context import ForwardContext, StaticInputs
from graphcp.model.llama import DecoderModel
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.decode.batch import PreparedStep


@dataclass
class StepBody:
    """What a decode step's forward runs with (the engine's model, cache and groups)."""

    model: DecoderModel
    kv: PagedKVCache
    group: CPGroup  # the CP group: the merge's
    device: torch.device
    backend: Any  # the engine's attention backend (eager steps)
    exchange: KVExchange  # its decode phase stores and attends
    comm: ReplicatedRows
    merge: str = "auto"  # RuntimeConfig.decode_merge

    def plan(self, rows: int) -> str:
        """The merge of a step of ``rows`` rows (the exchange's decode step decides)."""
        cfg = self.model.attn_cfg  # this rank's heads
        return self.exchange.decode.plan(rows, cfg.num_heads, cfg.head_dim, self.group.size,
                                         self.model.dtype.itemsize, self.merge)

    def context(self, meta: AttentionMetadata, slots: torch.Tensor, backend: Any, plan: str, live: int,
                stats: dict | None) -> ForwardContext:
        """A step's forward context: the exchange's decode step over ``meta``, this rank's
        ``slots`` of the new tokens (-1: another rank stores it), the rows replicated."""
        fwd = KVForward(self.kv, self.exchange, self.group, backend, meta, slots, plan, phase=DECODE)
        return ForwardContext(fwd, StaticInputs(live_rows=live), stats, None, self.comm)

    def run(self, ctx: ForwardContext, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rows through the stage: the final-normed hidden states, [rows, hidden]."""
        return self.model.body(ids, positions, ctx)

    def eager(self, step: PreparedStep, stats: dict) -> torch.Tensor:
        """The step on the engine's backend over its live metadata."""
        dev = self.device
        self.backend.prepare(step.meta)
        with nvtx_range("decode_eager", category="eager"):
            ctx = self.context(step.meta, torch.from_numpy(step.slots.slots).to(dev), self.backend, step.merge,
                               step.num_requests, stats)
            return self.run(ctx, torch.from_numpy(step.tokens).to(dev),
                            torch.from_numpy(step.slots.positions).to(dev))
