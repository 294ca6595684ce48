"""One layer's CP attention as the model calls it, for either KV cache mode.

- ``begin_forward`` (the body's first step): the replicated cache all-gathers the
  slot mapping once per forward; the sharded cache needs nothing.
- ``store_kv`` (inside a captured segment): replicated, all-gather K/V and write
  every rank's rows (:mod:`graphcp.attention.exchange`); sharded, write this rank's
  own rows into its own pool (no collective).
- ``attend`` (the attention break): replicated, the backend over the local cache;
  sharded, the forward's ring (:mod:`graphcp.attention.ring.attention`), which counts the bytes
  it received into the forward's stats.
"""

from __future__ import annotations

import torch

from graphcp.attention.exchange import exchange_and_write_kv, gather_kv_slots
from graphcp.kv.layout import write_kv
from graphcp.model.forward_context import ForwardContext


def begin_forward(ctx: ForwardContext) -> None:
    if ctx.ring_attention is None:
        gather_kv_slots(ctx)


def store_kv(ctx: ForwardContext, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    if ctx.ring_attention is None:
        exchange_and_write_kv(ctx, layer, k, v)
    else:
        write_kv(ctx.kv_cache.layer(layer), k, v, ctx.kv_slots, ctx.kv_cache.layout)


def attend(ctx: ForwardContext, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
    if ctx.ring_attention is None:
        ctx.attention.forward(q, ctx.kv_cache.layer(layer), ctx.attn_meta, out)
    else:
        got = ctx.ring_attention.attend(ctx.ring, ctx.attention, ctx.kv_cache.layer(layer), q, out)
        ctx.add_received(got)
