"""Per-forward metadata, passed explicitly through the model (no globals).

The model reads only its inputs (ids, positions), the weights, the KV cache and
this object. A captured body holds the tensors of this object that are static
buffers; live host-side metadata (the attention segments) is read by the attention
break at replay through whatever context the replay passes in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from graphcp.attention.base import AttentionBackend, AttentionMetadata
from graphcp.attention.ring import RingAttention
from graphcp.attention.ring_plan import RingPlan
from graphcp.kvcache import PagedKVCache


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
    #: the sharded cache's ring (one per engine; None: the replicated cache's all-gather)
    ring_attention: RingAttention | None = None
    #: this forward's ring plan (live metadata the attention break reads)
    ring: RingPlan | None = None
    #: per-forward figures (ForwardInfo.stats): what the exchange received, ...
    stats: dict[str, Any] = field(default_factory=dict)

    def add_received(self, nbytes: int) -> None:
        """Count bytes of K/V (or queries and partial outputs) this rank received."""
        self.stats["bytes_received"] = self.stats.get("bytes_received", 0) + int(nbytes)
