"""Per-forward metadata, passed explicitly through the model (no globals).

The model reads only its inputs (ids, positions), the weights, the KV cache and
this object. A captured body holds the tensors of this object that are static
buffers; live host-side metadata (the attention segments, the ring's plan) is read by
the attention break at replay through whatever context the replay passes in.

The context is three groups and the forward's helpers: the KV exchange
(:class:`graphcp.attention.kv_exchange.KVForward`: the cache, how its mode stores and
attends in the forward's phase, the backend and its metadata), the static inputs
(:class:`StaticInputs`: the rows a captured graph's breaks read and write, the live row
count, the ids a layer reads) and the stats the forward counts into. The runtime builds
it in one place (``graphcp.runtime.body.Body.context``), for either phase
(graphcp.attention.phase): a prefill's rows split over the CP ranks, or a decode step's
one new token a request on every rank. The layers see the same context in both; a layer
with state of its own per request (a linear-attention layer's) reads :attr:`ForwardContext.phase`
to take its one-token step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from graphcp.attention.base import AttentionMetadata
from graphcp.attention.kv_exchange import KVForward
from graphcp.attention.phase import Phase
from graphcp.model.communicator import LayerCommunicator

#: the ForwardInfo.stats key of the bytes the KV exchange delivered to this rank (all layers)
KV_RECEIVED = "bytes_received"


@dataclass
class AuxCapture:
    """Where a forward copies auxiliary hidden states: the output rows of decoder
    layer ``layers[k]`` go to ``out[:, k]`` (``out``: [rows, len(layers), hidden],
    a static buffer on the graph path, so the copies are part of the captured
    segments)."""

    layers: tuple[int, ...]
    out: torch.Tensor

    def __post_init__(self) -> None:
        self._column = {layer: k for k, layer in enumerate(self.layers)}

    def write(self, layer: int, h: torch.Tensor) -> None:
        k = self._column.get(layer)
        if k is not None:
            self.out[:, k].copy_(h)


@dataclass
class StaticInputs:
    """A forward's rows besides ids and positions. Graph mode: the static attention
    input/output rows (breaks then read and write static buffers, so captured graphs pin
    no intermediate memory for them), a model's own break rows by name, and the residual
    rows into and out of an expert-parallel layer's break; eager: None."""

    attn_q: torch.Tensor | None = None
    attn_out: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] | None = None
    moe_resid: torch.Tensor | None = None
    moe_out: torch.Tensor | None = None
    #: this rank's live rows (the rest of the capacity is a bucket's padding); the
    #: expert-parallel MoE exchange routes only these. None: every row is live
    live_rows: int | None = None
    #: this rank's rows' token ids (set by a body whose layers read them: V4's hash routing)
    token_ids: torch.Tensor | None = None


@dataclass
class ForwardContext:
    #: the KV exchange: the cache, its mode's exchange, the backend, metadata and slots
    kv: KVForward
    #: the static inputs (graph mode's rows; the live row count)
    inputs: StaticInputs = field(default_factory=StaticInputs)
    #: this forward's figures (ForwardInfo.stats) that breaks (and, while a graph is
    #: captured, segments) add to as they run: what the exchange received, ...; None: not kept
    stats: dict[str, Any] | None = None
    #: auxiliary hidden states this forward copies out (None: none)
    aux: AuxCapture | None = None
    #: moves rows between the attention and FFN layouts (None: CP = TP over the CP group)
    comm: LayerCommunicator | None = None
    #: installed by graph capture; None runs breaks inline
    break_handler: Callable | None = None

    def __post_init__(self) -> None:
        if self.comm is None:
            self.comm = LayerCommunicator(self.kv.group)

    @property
    def phase(self) -> Phase:
        """The forward's phase: ``prefill`` or ``decode`` (graphcp.attention.phase)."""
        return self.kv.phase

    @property
    def group(self):
        """The CP group (collectives); a size-1 group on one rank."""
        return self.kv.group

    @property
    def attn_meta(self) -> AttentionMetadata:
        """The attention metadata this forward's body runs with (static in a full graph)."""
        return self.kv.meta

    def add_received(self, nbytes: int) -> None:
        """Count bytes of K/V (or queries and partial outputs) this rank received."""
        if self.stats is not None and nbytes:
            self.stats[KV_RECEIVED] = self.stats.get(KV_RECEIVED, 0) + int(nbytes)
