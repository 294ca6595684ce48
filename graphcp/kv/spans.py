"""Which rank holds which part of a request's KV: the extension point every cache
mode implements so that an export (``graphcp.pd``) can put a request's KV together
without gathering the pool anywhere.

A request's KV is cut into :class:`KVSpan` pieces, each one layer's token positions
``[start, stop)``, with the one rank (``owner``) that exports it to a transport.
A cache mode (:class:`KVSource`) says, identically on every rank,

- ``kv_spans(handle, cp_size)``: the spans that cover every (layer, position) of the
  request exactly once, in layer-then-position order;
- ``holds(span, rank)``: whether ``rank`` can read a span locally (a replicated
  cache: every rank; a layer-split cache: the layer's owner; a token-sharded cache:
  the rank that stored those positions);
- ``read_span(handle, span)``: on a rank that holds it, the span's K and V as
  ``[num_kv_heads, stop - start, head_dim]`` tensors in the cache dtype (a family's own
  cache: the tensors its export format's ``layer_tensors`` name, graphcp.pd.layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class KVSpan:
    layer: int
    start: int  # first token position
    stop: int  # one past the last
    owner: int  # the rank that exports it

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


class KVSource(Protocol):
    """What an export reads a request from (the module doc): a cache, or a family's reader
    of its cache (``ModelFamily.export_source``)."""

    def kv_spans(self, handle, cp_size: int) -> list[KVSpan]: ...

    def holds(self, span: KVSpan, rank: int) -> bool: ...

    def read_span(self, handle, span: KVSpan) -> Sequence[torch.Tensor]:
        """K and V (a family's own cache: the tensors its export format names)."""
        ...


def layers_per_rank(num_layers: int, cp_size: int) -> int:
    """ceil(L / C): the contiguous layers each rank owns under a layer split."""
    return -(-num_layers // cp_size)


def owned_layers(rank: int, num_layers: int, cp_size: int) -> range:
    """Rank ``rank``'s contiguous layers ``[r * k, min(L, (r + 1) * k))``, k = ceil(L / C)
    (empty for the last ranks when C > L)."""
    k = layers_per_rank(num_layers, cp_size)
    return range(min(num_layers, rank * k), min(num_layers, (rank + 1) * k))


def layer_owner(layer: int, num_layers: int, cp_size: int) -> int:
    return layer // layers_per_rank(num_layers, cp_size)


def whole_layer_spans(num_layers: int, num_tokens: int, cp_size: int, first_layer: int = 0) -> list[KVSpan]:
    """One span a layer over all tokens, exported by the layer's owner under the layer
    split (a replicated cache exports the same way, so C ranks send C contiguous parts).
    Spans name global decoder layers: a pipeline stage's cache holds ``num_layers``
    layers from ``first_layer`` on."""
    return [KVSpan(first_layer + i, 0, num_tokens, layer_owner(i, num_layers, cp_size)) for i in range(num_layers)]


def position_runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of consecutive values of increasing ``positions``."""
    if positions.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([positions[:1], positions[cuts]])
    stops = np.concatenate([positions[cuts - 1] + 1, positions[-1:] + 1])
    return list(zip(starts.tolist(), stops.tolist()))


def position_spans(num_layers: int, held: Sequence[np.ndarray], first_layer: int = 0) -> list[KVSpan]:
    """The spans of a cache that keeps each position on one rank (the token-sharded
    cache): ``held[r]`` the increasing positions rank r stores; per layer one span per
    run of consecutive positions, owned by the rank that stores it, in position order
    (global layers ``first_layer ..``, as :func:`whole_layer_spans`)."""
    runs = sorted((s, e, r) for r, pos in enumerate(held) for s, e in position_runs(np.asarray(pos)))
    return [KVSpan(layer, s, e, r) for layer in range(first_layer, first_layer + num_layers) for s, e, r in runs]
