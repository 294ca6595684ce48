"""The transformer body and what it runs against: the one way to run it, in either phase.

Eager forwards, graph capture, graph replay and the same-bucket eager check of a prefill
and of a decode step all go through :class:`Body`: ``context`` builds the per-forward
context from the prepared batch (and runs the attention backend's and the KV exchange's
host-side planning), ``run`` runs the body on it. The batch's phase
(graphcp.attention.phase) picks what differs: the exchange's operations its layers store
and attend through, and how its rows move between the attention and FFN layouts (a
prefill's split over the CP ranks; a decode step's the same on every rank, so the FFN
all-reduces its partial sums: ReplicatedRows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphcp.attention.base import Attention, AttentionMetadata, BatchRequests
from graphcp.attention.kv_exchange import KVExchange, KVForward
from graphcp.attention.phase import DECODE, PREFILL, Phase
from graphcp.attention.staging import to_device
from graphcp.dist import CPGroup
from graphcp.kv.decode import state_rows
from graphcp.kv.paged import PagedKVCache
from graphcp.model.communicator import LayerCommunicator, ReplicatedRows
from graphcp.model.forward_context import AuxCapture, ForwardContext, StaticInputs
from graphcp.model.llama import DecoderModel
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.batch import PreparedBatch


@dataclass
class Body:
    model: DecoderModel  # or a family's subclass of it
    #: the forward's attention (graphcp.attention.base: a backend over K/V heads, or a family's own, which
    #: takes the cache)
    attention: Attention
    kv: PagedKVCache
    group: CPGroup
    device: torch.device
    #: how the cache mode stores and attends (graphcp.attention.kv_exchange)
    exchange: KVExchange
    #: moves a prefill's rows between the attention and FFN layouts (None: CP = TP over ``group``)
    comm: LayerCommunicator | None = None
    #: how a decode step over a cache whose ranks hold parts of each request merges
    #: (RuntimeConfig.decode_merge)
    decode_merge: str = "auto"
    #: makes what an eager decode step attends with, on the first decode step (an engine
    #: that never decodes builds none): the attention backend's decode kernel when it takes
    #: a batch of any size (graphcp.attention.base.DecodeKernel; decode graphs capture the
    #: same one), else None: the attention backend
    make_decode_attention: Callable[[], Attention | None] | None = None

    def __post_init__(self) -> None:
        c = LayerCommunicator.of(self.comm or self.group)
        #: each phase's row layout: a decode step's rows are the same on every rank
        self.comms: dict[Phase, LayerCommunicator | None] = {
            PREFILL: self.comm, DECODE: ReplicatedRows(c.cp, c.attn_tp, c.ffn, c.dp)}
        self._decode_attention: Attention | None = None

    @property
    def decode_attention(self) -> Attention | None:
        """What an eager decode step attends with (see ``make_decode_attention``), made once."""
        if self.make_decode_attention is not None:
            self._decode_attention, self.make_decode_attention = self.make_decode_attention(), None
        return self._decode_attention

    def plan_decode(self, rows: int) -> Any:
        """The exchange's decode plan of a step of ``rows`` rows (how it merges)."""
        cfg = self.model.attn_cfg  # this rank's heads
        return self.exchange.decode.plan(rows, cfg.num_heads, cfg.head_dim, self.group.size, self.model.dtype.itemsize,
                                         self.decode_merge)

    def inert_plan(self, phase: Phase, rows: int) -> Any:
        """The exchange's plan of a batch of ``rows`` rows without a live one (what a graph
        is captured with): a decode graph's merge is fixed by its rows."""
        return self.exchange.inert_plan(self.group) if phase == PREFILL else self.plan_decode(rows)

    def reserve(self, capacity: int) -> None:
        """Before a bucket's capture: what a replay of ``capacity`` local rows must not
        allocate (a ring's buffers; nothing for the all-gather)."""
        cfg = self.model.attn_cfg  # this rank's heads
        self.exchange.reserve(capacity, self.kv, self.model.stage.layers.start, cfg.num_heads, cfg.head_dim,
                              self.model.dtype)

    @property
    def takes_hidden(self) -> bool:
        """A pipeline stage after the first: its input is the previous stage's hidden rows."""
        return not self.model.stage.first

    def context(self, prep: PreparedBatch | None, slots: torch.Tensor, static=None, *, phase: Phase = PREFILL,
                meta: AttentionMetadata | None = None, attention: Attention | None = None, stats: dict | None = None,
                aux: AuxCapture | None = None, state_slots: torch.Tensor | None = None,
                state_rows: int = 1) -> ForwardContext:
        """The context of one forward of ``prep`` (None: an inert batch of ``phase``, as a
        capture runs) on this rank's ``slots``, after the attention backend's host-side
        planning of the batch and the exchange's. ``static``: a bucket's static views,
        whose rows the breaks then read and write; ``meta``: the metadata the body runs
        with when it is not the batch's (a full graph's static metadata, a decode graph's,
        or a capture's); ``attention``: the backend when it is not the engine's (a decode
        graph's, over its static metadata); ``stats``: this forward's ForwardInfo.stats,
        given the figures a prefill's row count fixes here (breaks add the rest as they
        run); ``aux``: where the forward copies auxiliary hidden states; ``state_slots``: a
        decode step's per-request state slots on a storage with states (KVForward.state_slots),
        ``state_rows`` the rows a request gives it (KVForward.state_rows)."""
        if prep is not None:
            phase = prep.phase
        live = prep.meta if prep is not None else meta
        if attention is not None:
            backend = attention
        else:
            eager = self.decode_attention if phase == DECODE else None
            backend = self.attention if eager is None else eager
        self._plan_attention(backend, live, prep)
        fwd = KVForward(self.kv, self.exchange, self.group, backend, live if meta is None else meta, slots,
                        prep.kv_plan if prep is not None else self.inert_plan(phase, slots.shape[0]),
                        self._prefix_pages(prep), phase, state_slots=state_slots, state_rows=state_rows)
        fwd.prepare()
        inputs = StaticInputs(live_rows=live.num_q_rows) if static is None else static.inputs(live.num_q_rows)
        if stats is not None and phase == PREFILL:  # (a decode step's replicated rows: none)
            stats.update(self.model.static_stats(slots.shape[0]))
        return ForwardContext(fwd, inputs, stats, aux, self.comms[phase])

    def _plan_attention(self, backend: Attention, live: AttentionMetadata, prep: PreparedBatch | None) -> None:
        """The backend's host-side planning of the live batch (a backend that reads every
        request of it, DeepSeek V4's pooling, is given them; an inert batch none)."""
        if backend.reads_batch:
            backend.prepare(live, None if prep is None else self.requests(prep))
        else:
            backend.prepare(live)

    def _prefix_pages(self, prep: PreparedBatch | None) -> torch.Tensor | None:
        pages = None if prep is None else prep.prefix_pages
        return None if pages is None else to_device(pages, self.device)

    def requests(self, batch: PreparedBatch) -> BatchRequests:
        """Every request of a prepared batch: lengths and pages (the same on every rank); a
        decode step's: one new token after each request's ``positions``."""
        pages = self.kv.page_table(batch.seq_ids)
        if batch.phase == DECODE:
            return BatchRequests(batch.positions, np.ones_like(batch.positions), pages)
        return BatchRequests(batch.plan.prefix_lens, batch.plan.extend_lens, pages)

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
        states = None if prep.decode is None else prep.decode.states
        # ids, positions, slots (and a decode step's state slots): one upload
        rows = np.zeros((3 if states is None else 5, capacity), dtype=np.int64)
        rows[2, n:] = -1
        rows[0, :n], rows[1, :n], rows[2, :n] = prep.ids, prep.positions, prep.slots
        if states is not None:
            state_rows(states, capacity, rows[3:])
        dev = self.device
        if hidden_in is not None and hidden_in.shape[0] != capacity:
            padded = torch.zeros(capacity, hidden_in.shape[1], dtype=hidden_in.dtype, device=dev)
            padded[:n].copy_(hidden_in[:n])
            hidden_in = padded
        with nvtx_range("eager_body", category="eager"):
            up = to_device(rows, dev)
            ids, pos, slots = up[0], up[1], up[2]
            ctx = self.context(prep, slots, stats=prep.stats, aux=aux, state_slots=None if states is None else up[3:],
                               state_rows=prep.decode.rows_per_request if states is not None else 1)
            return self.run(ctx, ids, pos, hidden_in)
