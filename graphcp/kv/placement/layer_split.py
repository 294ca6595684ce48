"""LayerSplit: each CP rank keeps the cache of a contiguous range of layers.

Rank r owns layers ``[r * k, (r + 1) * k)``, k = ceil(L / C), for every request
(graphcp.kv.spans.owned_layers); under pipeline stages L is the stage's layers, counted
from the stage's first. Its storage holds those layers plus **one scratch layer** a pool
(graphcp.kv.layers.LayerSlots): the forward's all-gathered KV of every other layer is
written into the scratch (the exchange writes ``layer(i)`` whatever it is), which is
reused layer after layer. A rank's pool is so (k + 1) / L of the replicated one.

The tokens are placed as by the replicated cache: the allocator, page tables and
handles are identical on every rank, so the attention metadata does not change. What
changes is a cached prefix: its KV of layer i lives on layer i's owner only. Before
layer i's attention (in the attention break, where the live batch's page list is
known) the owner broadcasts exactly the prefix's pages of every pool of that layer, and
the other ranks copy them into their scratch: attention then reads the same values as
with a replicated cache, so the logits are bitwise those of the replicated engine.

Graphs: breakable graphs capture the exchange and the scratch writes (static shapes);
the broadcast runs in the attention break. A full graph has no break, so
``RuntimeConfig`` refuses ``graph='full'`` with this cache.
"""

from __future__ import annotations

import numpy as np
import torch

from graphcp.dist import CPGroup
from graphcp.kv.allocator import PageAllocator
from graphcp.kv.handle import KVHandle
from graphcp.kv.layers import HeldLayers
from graphcp.kv.placement.base import Placement
from graphcp.kv.spans import KVSpan, owned_layers
from graphcp.kv.spec import PoolSpec


class LayerSplitPlacement(Placement):
    mode = "layer-split"
    exchange = "all-gather"

    def __init__(self, allocator: PageAllocator, pool: PoolSpec) -> None:
        super().__init__(allocator, pool)
        self.split = self.held_layers(pool)
        #: the global layers this rank owns
        self.owned = self.split.held

    @classmethod
    def held_layers(cls, pool: PoolSpec) -> HeldLayers:
        """Rank ``pool.rank``'s own layers of ``pool.layers`` (empty for the last ranks when C > L)."""
        local = owned_layers(pool.rank, len(pool.layers), pool.cp_size)
        first = pool.layers.start
        return HeldLayers(pool.layers, range(first + local.start, first + local.stop), pool.cp_size, split=True)

    def owner(self, layer: int) -> int:
        return self.split.owner(layer)

    def stored_tokens_of(self, layer: int, batch_tokens: int, local_rows: int) -> int:
        """The layer's owner keeps it, the others write a scratch layer."""
        return batch_tokens if layer in self.owned else 0

    def attention_holder(self, layer: int) -> int:
        """A decode step attends over ``layer`` on its owner, the one rank that keeps it."""
        return self.owner(layer)

    def prefix_pages(self, prefixes: "list[KVHandle | None]") -> np.ndarray | None:
        """Every page of the batch's cached prefixes (what attention reads of them); None
        when no request extends a prefix."""
        pages = [p for h in prefixes if h is not None for p in h.pages]
        return np.asarray(pages, dtype=np.int64) if pages else None

    def fetch_prefix(self, layer: int, pools: list[torch.Tensor], pages: torch.Tensor, group: CPGroup) -> int:
        """Before ``layer``'s attention: its owner broadcasts the cached-prefix ``pages``
        (int64, on the pools' device) of every per-page tensor of that layer (``pools``,
        packed: one message), the other ranks copy them into their scratch layer(s).
        Every rank calls it (a collective). Returns the bytes this rank received (0 on
        the owner), for the forward's stats."""
        src, n = self.owner(layer), pages.shape[0]
        if group.rank == src:
            parts = [c.index_select(0, pages).reshape(n, -1) for c in pools]
            group.broadcast_(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1), src)
            return 0
        widths = [c[0].numel() for c in pools]
        buf = torch.empty((n, sum(widths)), dtype=pools[0].dtype, device=pools[0].device)
        group.broadcast_(buf, src)
        for c, part in zip(pools, buf.split(widths, dim=1)):
            c.index_copy_(0, pages, part.reshape(n, *c.shape[1:]))
        return buf.numel() * buf.element_size()

    def holds(self, span: KVSpan, rank: int) -> bool:
        return rank == self.owner(span.layer)

    def check_read(self, span: KVSpan) -> None:
        if span.layer not in self.owned:
            raise ValueError(f"rank {self.rank} does not hold layer {span.layer} (it owns layers "
                             f"{self.owned.start}..{self.owned.stop - 1}); read it on rank {self.owner(span.layer)}")
