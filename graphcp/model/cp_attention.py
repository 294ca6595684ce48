"""One layer's KV store and attention as the model calls them, whatever the cache mode
and the phase: each call goes to the forward's KV exchange (graphcp.attention.kv_exchange)
in the forward's phase (graphcp.attention.phase: a prefill's operations, or a decode
step's), and counts the bytes it received into the forward's stats.

- ``begin_forward`` (the body's first step), ``store_kv`` / ``store_rows`` (inside a
  captured segment): what the mode's exchange does (the all-gather, or a rank's own write);
- ``fetch_prefix`` and ``attend`` (the attention break): the cached prefix a cache that
  does not keep every layer fetches, then the backend over the cache, or the ring;
  ``attend_own``: a family's own attention over its cache, where the phase runs it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from graphcp.model.forward_context import ForwardContext


def begin_forward(ctx: ForwardContext) -> None:
    ctx.kv.begin()


def store_kv(ctx: ForwardContext, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    ctx.add_received(ctx.kv.store(layer, k, v))


def store_rows(ctx: ForwardContext, layer: int, rows: torch.Tensor) -> None:
    """A family's own cache rows of one layer (MLA's latent and keys, V4's window and sources)."""
    ctx.add_received(ctx.kv.store_rows(layer, rows))


def fetch_prefix(ctx: ForwardContext, layer: int) -> None:
    """Before a sparse family's attention: the cached prefix of this layer its cache lacks."""
    ctx.add_received(ctx.kv.fetch_prefix(layer))


def attend(ctx: ForwardContext, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
    ctx.add_received(ctx.kv.attend(layer, q, out))


def attend_own(ctx: ForwardContext, layer: int, run: Callable[[], None], outs: Sequence[torch.Tensor]) -> None:
    """A family's own attention of one layer (``run()`` writes ``outs``), where the
    forward's phase runs it: a prefill after fetching the cached prefix its cache lacks;
    a decode step on every rank, or on the layer's one holder, which broadcasts ``outs``."""
    ctx.add_received(ctx.kv.attend_own(layer, run, outs))
