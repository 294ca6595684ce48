"""Which of a cache's layers a rank keeps, and where each lives in a pool.

A placement says which of the layers a cache serves this rank keeps
(:class:`HeldLayers`: every one, or under the layer split its own); a storage lays
each of its pools out by it (:class:`LayerSlots`: the kept layers in order, then, when
some served layer is kept elsewhere, one scratch layer the others are written to).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from graphcp.kv.spans import layer_owner


@dataclass(frozen=True)
class HeldLayers:
    """``served``: the global layers the cache serves (a pipeline stage's, and an EAGLE-3
    draft's after them); ``held``: those whose pools this rank keeps; ``split``: each
    layer is kept by one rank of ``cp_size`` (its owner, graphcp.kv.spans.layer_owner),
    the others writing it to a scratch layer and fetching a prefix from the owner."""

    served: range
    held: range
    cp_size: int = 1
    split: bool = False

    def owner(self, layer: int) -> int | None:
        """The one rank that keeps ``layer``; None when every rank keeps it."""
        if not self.split:
            return None
        return layer_owner(layer - self.served.start, len(self.served), self.cp_size)


class LayerSlots:
    """Where each of one pool's ``layers`` (some of the served ones: every one, the
    full-attention ones, those that run an indexer...) lives in the pool: a kept layer at
    its own index, in layer order; with ``scratch``, a layer kept by another rank at the
    one scratch index after them. ``scratch`` defaults to ``held.split``. ``what``: how a
    served layer missing from ``layers`` is refused (``"layer {i} <what>"``)."""

    def __init__(self, held: HeldLayers, layers: Sequence[int] | None = None, scratch: bool | None = None,
                 what: str = "has no entry in this pool") -> None:
        layers = held.served if layers is None else layers
        self.held, self.what = held, what
        #: the layers kept here, in pool order
        self.kept = tuple(i for i in layers if i in held.held)
        scratch = held.split if scratch is None else scratch
        #: the pool's layers: the kept ones and the scratch layer when there is one
        self.depth = len(self.kept) + int(scratch)
        #: global layer -> its index in the pool (every one of ``layers`` this rank may write)
        self.index = {i: j for j, i in enumerate(self.kept)}
        if scratch:
            self.index.update((i, len(self.kept)) for i in layers if i not in self.index)

    def __getitem__(self, layer: int) -> int:
        j = self.index.get(layer)
        if j is None:
            self.refuse(layer)
        return j

    def refuse(self, layer: int) -> None:
        """IndexError naming why ``layer`` has no place in the pool."""
        served = self.held.served
        span = f"{served.start}..{served.stop - 1}"
        if layer not in served and self.held.split:
            raise IndexError(f"layer {layer} is not split here: this cache splits layers {span}")
        if layer not in served:
            raise IndexError(f"layer {layer} is not cached here: this KV cache holds layers {span}")
        raise IndexError(f"layer {layer} {self.what}")
