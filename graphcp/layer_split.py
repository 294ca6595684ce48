"""LayerSplit: each CP rank keeps the KV cache of a contiguous range of layers.

Rank r owns layers ``[r * k, (r + 1) * k)``, k = ceil(L / C), for every request
(graphcp.kvspans.owned_layers). Its pool holds those layers plus **one scratch
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

Graphs: breakable graphs capture the exchange and the scratch writes (static shapes);
the broadcast runs in the attention break. A full graph has no break, so
``RuntimeConfig`` refuses ``graph='full'`` with this cache.
"""

from __future__ import annotations

import torch

from graphcp.attention.base import KVLayout
from graphcp.dist import CPGroup
from graphcp.kvcache import KVHandle, PagedKVCache
from graphcp.kvspans import KVSpan, layer_owner, owned_layers


def pool_layers(num_layers: int, rank: int, cp_size: int) -> int:
    """Layers a rank's layer-split pool holds: its own and the scratch layer."""
    return len(owned_layers(rank, num_layers, cp_size)) + 1


class LayerSplitKVCache(PagedKVCache):
    needs_prefix_fetch = True

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, layout: KVLayout, max_pages_per_seq: int | None,
                 rank: int, cp_size: int) -> None:
        super().__init__(pool_layers(num_layers, rank, cp_size), num_pages, page_size, num_kv_heads, head_dim,
                         dtype, device, layout, max_pages_per_seq)
        self.num_layers = num_layers  # the model's; the pool holds len(owned) + 1 of them
        self.rank, self.cp_size = rank, cp_size
        self.owned = owned_layers(rank, num_layers, cp_size)
        self.scratch_layer = self.pool.shape[0] - 1

    def owner(self, layer: int) -> int:
        return layer_owner(layer, self.num_layers, self.cp_size)

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``'s cache when this rank owns it, else the shared scratch layer."""
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} is outside the model's {self.num_layers} layers")
        return self.pool[i - self.owned.start] if i in self.owned else self.pool[self.scratch_layer]

    def holds(self, span: KVSpan, rank: int) -> bool:
        return rank == self.owner(span.layer)

    def read_span(self, handle: KVHandle, span: KVSpan) -> tuple[torch.Tensor, torch.Tensor]:
        if span.layer not in self.owned:
            raise ValueError(f"rank {self.rank} does not hold layer {span.layer} (it owns layers "
                             f"{self.owned.start}..{self.owned.stop - 1}); read it on rank {self.owner(span.layer)}")
        return super().read_span(handle, span)

    def fetch_prefix(self, layer: int, pages: torch.Tensor, group: CPGroup) -> int:
        """Before ``layer``'s attention: its owner broadcasts the cached-prefix ``pages``
        (int64, on the pool's device) of that layer; the other ranks copy them into the
        scratch layer. Every rank calls it (a collective). Returns the bytes this rank
        received (0 on the owner), for the forward's stats."""
        src = self.owner(layer)
        cache = self.layer(layer)
        if group.rank == src:
            group.broadcast_(cache.index_select(0, pages), src)
            return 0
        buf = torch.empty((pages.shape[0], *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
        cache.index_copy_(0, pages, group.broadcast_(buf, src))
        return buf.numel() * buf.element_size()
