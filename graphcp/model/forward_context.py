"""Per-forward metadata, passed explicitly through the model (no globals).

The model reads only its inputs (ids, positions), the weights, the KV cache and
this object. A captured body holds the tensors of this object that are static
buffers; live host-side metadata (the attention segments) is read by the attention
break at replay through whatever context the replay passes in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from graphcp.attention.base import AttentionBackend, AttentionMetadata
from graphcp.attention.ring.attention import RingAttention
from graphcp.attention.ring.plan import RingPlan
from graphcp.kv.paged import PagedKVCache
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
class ForwardContext:
    attn_meta: AttentionMetadata
    attention: AttentionBackend
    kv_cache: PagedKVCache
    #: cache slot of each of this rank's (padded) rows ([capacity]; -1 = padding)
    kv_slots: torch.Tensor
    #: the CP group (collectives); a size-1 group on one rank
    group: Any
    #: installed by graph capture; None runs breaks inline
    break_handler: Callable | None = None
    #: static attention input/output rows (graph mode): breaks then read and write
    #: static buffers, so captured graphs pin no intermediate memory for them
    attn_q: torch.Tensor | None = None
    attn_out: torch.Tensor | None = None
    #: every rank's ``kv_slots``, rank-major ([C * capacity]): set by the body's
    #: first step each run (so a captured body records the collective that makes it)
    gathered_kv_slots: torch.Tensor | None = None
    #: cache pages (int64) of the batch's cached prefixes, for a cache that fetches each
    #: layer's prefix KV before attention (LayerSplit); None: nothing to fetch
    prefix_pages: torch.Tensor | None = None
    #: the sharded cache's ring (one per engine; None: the replicated cache's all-gather)
    ring_attention: RingAttention | None = None
    #: this forward's ring plan (live metadata the attention break reads)
    ring: RingPlan | None = None
    #: a model's own static rows for its breaks (graph mode), by name; None: eager
    static_rows: dict[str, torch.Tensor] | None = None
    #: this rank's live rows (the rest of the capacity is a bucket's padding); the
    #: expert-parallel MoE exchange routes only these. None: every row is live
    live_rows: int | None = None
    #: static residual rows into and out of an expert-parallel layer's break (graph mode)
    moe_resid: torch.Tensor | None = None
    moe_out: torch.Tensor | None = None
    #: this forward's figures (ForwardInfo.stats) that breaks (and, while a graph is
    #: captured, segments) add to as they run: what the exchange received, ...; None: not kept
    stats: dict[str, Any] | None = None
    #: auxiliary hidden states this forward copies out (None: none)
    aux: AuxCapture | None = None
    #: moves rows between the attention and FFN layouts (None: CP = TP over ``group``)
    comm: LayerCommunicator | None = None
    #: this rank's rows' token ids (set by a body whose layers read them: V4's hash routing)
    token_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.comm is None:
            self.comm = LayerCommunicator(self.group)

    def add_received(self, nbytes: int) -> None:
        """Count bytes of K/V (or queries and partial outputs) this rank received."""
        if self.stats is not None:
            self.stats[KV_RECEIVED] = self.stats.get(KV_RECEIVED, 0) + int(nbytes)
