"""A forward's phase, and the contract a phase's layers store and attend through.

A forward runs one phase:

- ``prefill``: a batch's new tokens, split over the CP ranks by the layout; each rank
  holds its own rows;
- ``decode``: one new token a request, the same rows on every rank (docs/decode.md).

A KV exchange (graphcp.attention.kv_exchange) is its prefill phase's operations and names
its decode phase's (``KVExchange.decode``, graphcp.attention.decode.phases). A forward's
:class:`~graphcp.attention.kv_exchange.KVForward` carries its phase and holds that phase's
operations, so the model's layers call the same methods in both; a layer with state of
its own per request reads the phase from its forward context to take its one-token step.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Literal, Sequence

import torch

Phase = Literal["prefill", "decode"]
PREFILL: Phase = "prefill"
DECODE: Phase = "decode"


class ExchangePhase:
    """What a forward's layers store their K/V and attend through in one phase (the
    methods :class:`~graphcp.attention.kv_exchange.KVForward` calls with itself as
    ``fwd``). Each returns the bytes this rank received."""

    phase: ClassVar[Phase] = PREFILL

    def prepare(self, fwd) -> None:
        """Host-side planning of one forward, before the body runs."""

    def begin(self, fwd) -> None:
        """The body's first step."""

    def store(self, fwd, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        raise NotImplementedError

    def store_rows(self, fwd, layer: int, rows: torch.Tensor) -> int:
        raise NotImplementedError(f"the {self.phase} phase stores K/V heads, not a family's own cache rows")

    def attend(self, fwd, layer: int, q: torch.Tensor, out: torch.Tensor) -> int:
        raise NotImplementedError

    def attend_own(self, fwd, layer: int, run: Callable[[], None], outs: Sequence[torch.Tensor]) -> int:
        """A family's own attention of one layer (``run()``: it writes ``outs``, its output
        and what later layers read of it, such as a selection) where this phase runs it: a
        prefill's on every rank over its own rows, after the cached prefix a cache that
        does not keep the layer fetches from its owner."""
        got = fwd.fetch_prefix(layer)
        run()
        return got

    def describe(self, plan: Any) -> dict[str, Any]:
        """A forward's figures (its stats) given the plan it ran."""
        return {}
