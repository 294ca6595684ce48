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
    #: cache pages (int64) of the batch's cached prefixes, for a cache that fetches each
    #: layer's prefix KV before attention (LayerSplit); None: nothing to fetch
    prefix_pages: torch.Tensor | None = None
    #: this rank's live rows (the rest of the capacity is a bucket's padding); the
    #: expert-parallel MoE exchange routes only these. None: every row is live
    live_rows: int | None = None
    #: static residual rows into and out of an expert-parallel layer's break (graph mode)
    moe_resid: torch.Tensor | None = None
    moe_out: torch.Tensor | None = None
    #: this forward's figures (ForwardInfo.stats) that breaks add to as they run; None: not kept
    stats: dict[str, Any] | None = None
