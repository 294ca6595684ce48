"""LayerSplit: each CP rank keeps the KV cache of a contiguous range of layers.

Rank r owns layers ``[r * k, (r + 1) * k)``, k = ceil(L / C), for every request
(graphcp.kv.spans.owned_layers); under pipeline stages L is the stage's layers, counted
from the stage's first. Its pool holds those layers plus **one scratch
layer** with the same pages: the forward's all-gathered KV of every other layer is
written into the scratch (the exchange writes ``layer(i)`` whatever it is), which is
reused layer after layer. A rank's pool is so (k + 1) / L of the replicated one.

The page allocator, page tables and handles are the replicated cache's, identical on
every rank, so the attention metadata does not change. What changes is a cached
prefix: its KV of layer i lives on layer i's owner only. Before layer i's attention
(in the attention break, where the live batch's page list is known) the owner
broadcasts exactly the prefix's pages of that layer, and the other ranks copy them
into the scratch: attention then reads the same values as with a replicated cache, so
the logits are bitwise those of the replicated engine.

The ownership, the span checks and the prefix fetch live in :class:`LayerOwnership`,
shared with the layer splits of the families' own caches (in their folders).

Graphs: breakable graphs capture the exchange and the scratch writes (static shapes);
the broadcast runs in the attention break. A full graph has no break, so
``RuntimeConfig`` refuses ``graph='full'`` with this cache.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from graphcp.dist import CPGroup
from graphcp.kv.layout import KVLayout
from graphcp.kv.paged import KVHandle, PagedKVCache
from graphcp.kv.spans import KVSpan, layer_owner, owned_layers
from graphcp.kv.spec import KVHeads, PoolSpec


def pool_layers(num_layers: int, rank: int, cp_size: int) -> int:
    """Layers a rank's layer-split pool holds: its own and the scratch layer."""
    return len(owned_layers(rank, num_layers, cp_size)) + 1


class LayerOwnership:
    """What every layer-split cache shares (the dense one below, a family's own cache
    in its folder): who owns a layer, which spans a rank can read, and
    the prefix fetch before a layer's attention. A cache mixes it in ahead of its
    :class:`PagedKVCache` and calls :meth:`_split` before the pool is allocated."""

    mode = "layer-split"

    @classmethod
    def held_layers(cls, pool: PoolSpec) -> int:
        """A rank's own layers and the scratch layer."""
        return pool_layers(len(pool.layers), pool.rank, pool.cp_size)

    def prefix_pages(self, prefixes: "list[KVHandle | None]") -> np.ndarray | None:
        """Every page of the batch's cached prefixes (what attention reads of them); None
        when no request extends a prefix."""
        pages = [p for h in prefixes if h is not None for p in h.pages]
        return np.asarray(pages, dtype=np.int64) if pages else None

    def stored_tokens_of(self, layer: int, batch_tokens: int, local_rows: int) -> int:
        """The layer's owner keeps it, the others write a scratch layer."""
        return batch_tokens if layer in self.owned else 0

    def _split(self, num_layers: int, rank: int, cp_size: int, first_layer: int = 0) -> None:
        """Split the global layers ``first_layer .. first_layer + num_layers - 1`` (the
        model's, or a pipeline stage's) over the ``cp_size`` ranks."""
        self.split_layers, self.split_first = num_layers, first_layer  # a pool holds len(owned) + 1
        self.rank, self.cp_size = rank, cp_size
        local = owned_layers(rank, num_layers, cp_size)
        self.owned = range(first_layer + local.start, first_layer + local.stop)

    def owner(self, layer: int) -> int:
        return layer_owner(layer - self.split_first, self.split_layers, self.cp_size)

    def attention_holder(self, layer: int) -> int:
        """A decode step attends over ``layer`` on its owner, the one rank that keeps it."""
        return self.owner(layer)

    def pool_index(self, layer: int, owned: Sequence[int]) -> int:
        """Where ``layer`` lives in a pool holding the ``owned`` layers then one scratch
        layer: its own slot when this rank owns it, else the scratch."""
        first, n = self.split_first, self.split_layers
        if not first <= layer < first + n:
            raise IndexError(f"layer {layer} is not split here: this cache splits layers {first}..{first + n - 1}")
        return owned.index(layer) if layer in owned else len(owned)

    def holds(self, span: KVSpan, rank: int) -> bool:
        return rank == self.owner(span.layer)

    def read_span(self, handle: KVHandle, span: KVSpan):
        if span.layer not in self.owned:
            raise ValueError(f"rank {self.rank} does not hold layer {span.layer} (it owns layers "
                             f"{self.owned.start}..{self.owned.stop - 1}); read it on rank {self.owner(span.layer)}")
        return super().read_span(handle, span)

    def layer_pools(self, layer: int) -> list[torch.Tensor]:
        """``layer``'s per-page tensors (pages along dim 0) a prefix fetch fills."""
        raise NotImplementedError

    def fetch_prefix(self, layer: int, pages: torch.Tensor | None, group: CPGroup) -> int:
        """Before ``layer``'s attention: its owner broadcasts the cached-prefix ``pages``
        (int64, on the pool's device; None: no prefix to fetch) of every tensor of that layer (packed: one message),
        the other ranks copy them into their scratch layer(s). Every rank calls it (a
        collective). Returns the bytes this rank received (0 on the owner), for the
        forward's stats."""
        if pages is None:  # no request extends a cached prefix
            return 0
        src, n = self.owner(layer), pages.shape[0]
        caches = self.layer_pools(layer)
        if group.rank == src:
            parts = [c.index_select(0, pages).reshape(n, -1) for c in caches]
            group.broadcast_(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1), src)
            return 0
        widths = [c[0].numel() for c in caches]
        buf = torch.empty((n, sum(widths)), dtype=caches[0].dtype, device=caches[0].device)
        group.broadcast_(buf, src)
        for c, part in zip(caches, buf.split(widths, dim=1)):
            c.index_copy_(0, pages, part.reshape(n, *c.shape[1:]))
        return buf.numel() * buf.element_size()


class LayerSplitKVCache(LayerOwnership, PagedKVCache):
    @classmethod
    def create(cls, geometry: KVHeads, pool: PoolSpec) -> "LayerSplitKVCache":
        return cls(len(pool.layers), pool.num_pages, pool.page_size, geometry.num_kv_heads, geometry.head_dim,
                   pool.dtype, pool.device, geometry.layout, pool.max_pages_per_seq, rank=pool.rank,
                   cp_size=pool.cp_size, first_layer=pool.layers.start)

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, layout: KVLayout, max_pages_per_seq: int | None,
                 rank: int, cp_size: int, first_layer: int = 0) -> None:
        """``num_layers`` from ``first_layer``: the model's, or a pipeline stage's layers."""
        self._split(num_layers, rank, cp_size, first_layer)
        super().__init__(pool_layers(num_layers, rank, cp_size), num_pages, page_size, num_kv_heads, head_dim,
                         dtype, device, layout, max_pages_per_seq, first_layer)
        self.num_layers = num_layers  # the split's; the pool holds len(owned) + 1 of them
        self.scratch_layer = self.pool.shape[0] - 1

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``'s cache when this rank owns it, else the shared scratch layer."""
        return self.pool[self.pool_index(i, self.owned)]

    def layer_pools(self, layer: int) -> list[torch.Tensor]:
        return [self.layer(layer)]
