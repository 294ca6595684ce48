"""The transformer body and what it runs against: the one way to run it.

Eager forwards, graph capture, graph replay and the same-bucket eager check all
go through :class:`Body`: ``context`` builds the per-forward context (and runs
the attention backend's host-side planning), ``run`` runs the body on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphcp.attention.base import AttentionBackend, AttentionMetadata
from graphcp.attention.ring.attention import RingAttention
from graphcp.attention.ring.plan import RingPlan
from graphcp.attention.sparse.dsv4 import BatchRequests
from graphcp.attention.sparse.mla import SparseMlaBackend
from graphcp.dist import CPGroup
from graphcp.kv.paged import PagedKVCache
from graphcp.model.communicator import LayerCommunicator
from graphcp.model.forward_context import AuxCapture, ForwardContext
from graphcp.model.llama import DecoderModel
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.batch import PreparedBatch


@dataclass
class Body:
    model: DecoderModel  # or a DsaModel (a DecoderModel with DSA layers)
    attention: AttentionBackend | SparseMlaBackend
    kv: PagedKVCache
    group: CPGroup
    device: torch.device
    #: the sharded cache's ring (None: the replicated cache)
    ring: RingAttention | None = None
    #: moves rows between the attention and FFN layouts (None: CP = TP over ``group``)
    comm: LayerCommunicator | None = None

    def reserve_ring(self, capacity: int) -> None:
        """Before a bucket's capture: the ring's buffers for ``capacity`` local rows, so its
        replays allocate none (a sharded cache; nothing otherwise)."""
        if self.ring is not None:
            cfg = self.model.attn_cfg  # this rank's heads
            layer = self.kv.layer(self.model.stage.layers.start)
            self.ring.reserve(capacity, layer, cfg.num_heads, cfg.head_dim, self.model.dtype)

    @property
    def takes_hidden(self) -> bool:
        """A pipeline stage after the first: its input is the previous stage's hidden rows."""
        return not self.model.stage.first

    def context(self, meta: AttentionMetadata, kv_slots: torch.Tensor, static=None,
                plan: AttentionMetadata | None = None, ring: RingPlan | None = None,
                stats: dict | None = None, aux: AuxCapture | None = None,
                prefix_pages: np.ndarray | None = None, batch: PreparedBatch | None = None) -> ForwardContext:
        """The context of one forward over ``meta``, after the attention backend's
        host-side planning for ``plan`` (default ``meta``: a full graph's context
        holds static metadata while the backend plans the live batch). ``static``: a
        bucket's static views, whose attention rows the breaks then read and write.
        ``ring``: the forward's ring plan (a sharded cache; None plans an inert one);
        ``stats``: this forward's ForwardInfo.stats, given the figures the row count
        fixes here (breaks add the rest as they run). ``aux``: where the forward copies
        auxiliary hidden states; ``prefix_pages``: the batch's cached-prefix pages a
        LayerSplit cache fetches; ``batch``: the prepared batch of ``plan``, for a backend
        that reads every request of it (DeepSeek V4's pooling; None: an inert batch, as
        capture runs)."""
        live = meta if plan is None else plan
        if getattr(self.attention, "reads_batch", False):
            self.attention.prepare(live, self.requests(batch) if batch is not None and batch.meta is live else None)
        else:
            self.attention.prepare(live)
        ctx = ForwardContext(meta, self.attention, self.kv, kv_slots, self.group, aux=aux, comm=self.comm)
        ctx.live_rows = live.num_q_rows
        if prefix_pages is not None:
            ctx.prefix_pages = torch.from_numpy(prefix_pages).to(self.device)
        if self.ring is not None:
            ctx.ring_attention = self.ring
            ctx.ring = ring if ring is not None else RingPlan.inert(self.group.size, self.group.rank)
            self.ring.prepare(ctx.ring)
        if static is not None:
            ctx.attn_q, ctx.attn_out = static.attn_q, static.attn_out
            ctx.static_rows = static.extra or None
            ctx.moe_resid, ctx.moe_out = static.moe_resid, static.moe_out
        if stats is not None:
            stats.update(self.model.static_stats(kv_slots.shape[0]))
            ctx.stats = stats
        return ctx

    def requests(self, batch: PreparedBatch) -> BatchRequests:
        """Every request of a prepared batch: lengths and pages (the same on every rank)."""
        return BatchRequests(batch.plan.prefix_lens, batch.plan.extend_lens, self.kv.page_table(batch.seq_ids))

    def run(self, ctx: ForwardContext, input_ids: torch.Tensor, positions: torch.Tensor,
            hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """Local rows in, hidden states of the same rows out (final-normed on the
        last pipeline stage); ``hidden_in``: a later stage's input rows."""
        return self.model.body(input_ids, positions, ctx, hidden_in)

    @torch.inference_mode()
    def eager(self, prep: PreparedBatch, capacity: int, hidden_in: torch.Tensor | None = None,
              aux: AuxCapture | None = None) -> torch.Tensor:
        """A prepared batch run eagerly on ``capacity`` rows (>= the largest rank's
        rows), padded as a bucket is: token 0, position 0, slot -1 (and zero input
        rows on a later pipeline stage, whose live rows are ``hidden_in``)."""
        n = prep.ids.shape[0]
        ids = np.zeros(capacity, dtype=np.int64)
        pos = np.zeros(capacity, dtype=np.int64)
        slots = np.full(capacity, -1, dtype=np.int64)
        ids[:n], pos[:n], slots[:n] = prep.ids, prep.positions, prep.slots
        dev = self.device
        if hidden_in is not None and hidden_in.shape[0] != capacity:
            rows = torch.zeros(capacity, hidden_in.shape[1], dtype=hidden_in.dtype, device=dev)
            rows[:n].copy_(hidden_in[:n])
            hidden_in = rows
        with nvtx_range("eager_body", category="eager"):
            ctx = self.context(prep.meta, torch.from_numpy(slots).to(dev), ring=prep.ring, stats=prep.stats, aux=aux,
                               prefix_pages=prep.prefix_pages, batch=prep)
            return self.run(ctx, torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev), hidden_in)
