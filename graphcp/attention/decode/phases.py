"""The decode phase of each KV exchange (graphcp.attention.kv_exchange): what a decode
step's layers store and attend through (a :class:`~graphcp.attention.kv_exchange.KVForward`
of the decode phase calls ``begin``, ``store`` and ``attend`` as a prefill's does).

In a decode step every rank computes every request's new row (one a request), so a
layer's K/V needs no exchange: each rank writes the rows its cache keeps (the slots the
cache mode reserved; -1, a row another rank stores, lands in the scratch page). Attention
is where the modes differ:

- :class:`LocalDecode` (the all-gather exchange: replicated and layer-split caches): a
  rank attends over its own cache; a layer kept by one rank only (layer-split) is
  attended there and its output broadcast;
- :class:`MergedDecode` (the ring: the token-sharded cache): each rank attends over its
  share of every request, and the partial outputs are merged by their LSE
  (graphcp.attention.decode.merge).

A step's plan (the KVForward's ``plan``) is how it merges: :meth:`DecodePhase.plan`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from graphcp.attention.decode.merge import MERGE_FUNCTIONS, choose_merge
from graphcp.attention.phase import DECODE, ExchangePhase
from graphcp.kv.layout import write_kv


class DecodePhase(ExchangePhase):
    """A decode step's store and attention (see the module doc)."""

    phase = DECODE
    name = "decode"

    def plan(self, rows: int, heads: int, head_dim: int, cp_size: int, itemsize: int, setting: str = "auto") -> str:
        """How a step of ``rows`` rows merges its partial outputs (its stats' ``decode_merge``;
        ``setting``: RuntimeConfig.decode_merge, for an exchange whose ranks hold parts of
        each request)."""
        return "none"

    def store(self, fwd, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """The rows this rank's cache keeps, written in place; no collective."""
        write_kv(fwd.cache.layer(layer), k, v, fwd.slots, fwd.cache.layout)
        return 0

    def store_rows(self, fwd, layer: int, rows: torch.Tensor) -> int:
        """A family's own cache rows (a latent row and its indexer keys, a window's rows) this
        rank's cache keeps, written in place (the cache's ``write``); no collective."""
        fwd.cache.write(layer, rows, fwd.slots)
        return 0

    def attend_own(self, fwd, layer: int, run: Callable[[], None], outs: Sequence[torch.Tensor]) -> int:
        """A family's own attention over a cache whose ranks hold parts of each request: not
        built (such a family's cache is refused with the token-sharded cache)."""
        raise NotImplementedError(f"the {self.name} decode phase attends K/V heads, not a family's own cache")

    def describe(self, plan: Any) -> dict[str, Any]:
        return {"decode_merge": plan}


class LocalDecode(DecodePhase):
    """The all-gather exchange's decode phase: each rank attends over its own cache, or the
    one rank that keeps a layer does and broadcasts the output."""

    name = "local"

    def attend(self, fwd, layer: int, q: torch.Tensor, out: torch.Tensor) -> int:
        holder = fwd.cache.attention_holder(layer)
        if holder is None or fwd.group.rank == holder:
            fwd.backend.forward(q, fwd.cache.layer(layer), fwd.meta, out)
        if holder is None:
            return 0
        fwd.group.broadcast_(out, holder)
        return 0 if fwd.group.rank == holder else out.nbytes

    def attend_own(self, fwd, layer: int, run: Callable[[], None], outs: Sequence[torch.Tensor]) -> int:
        """A family's own attention (its sparse attention over its cache): on every rank, or
        on the one rank that keeps the layer, which broadcasts ``outs`` (the output and
        what later layers read of this one: a selection a GLM 'shared' layer reuses)."""
        holder = fwd.cache.attention_holder(layer)
        if holder is None or fwd.group.rank == holder:
            run()
        if holder is None:
            return 0
        for t in outs:
            fwd.group.broadcast_(t, holder)
        return 0 if fwd.group.rank == holder else sum(t.nbytes for t in outs)

    def plan(self, rows: int, heads: int, head_dim: int, cp_size: int, itemsize: int, setting: str = "auto") -> str:
        return "local"


class MergedDecode(DecodePhase):
    """The ring's decode phase: a partial attention over this rank's share of every
    request, merged over the CP group (the plan: ``all-gather`` or ``all-to-all``)."""

    name = "merged"

    def plan(self, rows: int, heads: int, head_dim: int, cp_size: int, itemsize: int, setting: str = "auto") -> str:
        return choose_merge(setting, rows, heads, head_dim, cp_size, itemsize)

    def attend(self, fwd, layer: int, q: torch.Tensor, out: torch.Tensor) -> int:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        fwd.backend.forward(q, fwd.cache.layer(layer), fwd.meta, out, lse)
        return MERGE_FUNCTIONS[fwd.plan](fwd.group, out, lse)
