"""LayerSplit of a DSA model's cache: each CP rank keeps MLA's latent + rope key of its
own layers, and the indexer keys of those of them that run the indexer.

The ownership is the dense layer split's (graphcp.kv.layer_split.LayerOwnership: rank r
owns layers ``[r * k, (r + 1) * k)``, k = ceil(L / C)); each pool holds the owned
layers plus **one scratch layer**:

- ``pool``: ``[len(owned) + 1, num_pages, page_size, latent_dim]``;
- ``index_pool``: ``[owned indexer layers + 1, num_pages, page_size, index_dim]``.

The exchange writes every layer's all-gathered rows (latent, rope key, indexer key)
where :meth:`latent` / :meth:`index_keys` point: a layer's own slots on its owner, the
scratch elsewhere. In the attention break (``run_sparse_mla``) the owner broadcasts
the batch's cached-prefix pages of that layer, latent and indexer keys in one message,
before the indexer scores and the sparse attention read them: the same values as the
replicated cache, so the logits are bitwise the replicated engine's. A GLM "shared"
layer keeps no indexer keys (it reuses the last indexer layer's selection), so only
its latent is fetched.
"""

from __future__ import annotations

import torch

from graphcp.kv.layer_split import LayerOwnership, pool_layers
from graphcp.kv.spans import owned_layers
from graphcp.kv.spec import PoolSpec
from graphcp.model.dsa.cache import MlaGeometry, MlaKVCache


def mla_pool_layers(indexer_layers: tuple[bool, ...], rank: int, cp_size: int) -> tuple[int, int]:
    """Layers a rank's layer-split pools hold: (latent pool, indexer-key pool), each with its scratch layer."""
    owned = owned_layers(rank, len(indexer_layers), cp_size)
    return pool_layers(len(indexer_layers), rank, cp_size), sum(indexer_layers[i] for i in owned) + 1


class LayerSplitMlaKVCache(LayerOwnership, MlaKVCache):
    @classmethod
    def create(cls, geometry: MlaGeometry, pool: PoolSpec) -> "LayerSplitMlaKVCache":
        return cls(*cls._args(geometry, pool), rank=pool.rank, cp_size=pool.cp_size, first_layer=pool.layers.start)

    @classmethod
    def held_layers_of(cls, geometry: MlaGeometry, pool: PoolSpec) -> tuple[int, int]:
        return mla_pool_layers(geometry.indexer_of(pool.layers), pool.rank, pool.cp_size)

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int, rope_dim: int,
                 index_dim: int, indexer_layers: tuple[bool, ...], dtype: torch.dtype, device: torch.device | str,
                 max_pages_per_seq: int | None, rank: int, cp_size: int, first_layer: int = 0) -> None:
        self._split(num_layers, rank, cp_size, first_layer)
        #: the owned layers that run the indexer, in index_pool's order (its scratch after them)
        self.owned_index = ([i for i in self.owned if indexer_layers[i - first_layer]]
                            if len(indexer_layers) == num_layers else [])
        super().__init__(num_layers, num_pages, page_size, kv_lora_rank, rope_dim, index_dim, indexer_layers, dtype,
                         device, max_pages_per_seq, first_layer)

    def _allocate_pool(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        shape = (self.num_pages, self.page_size)
        self.index_pool = torch.zeros((len(self.owned_index) + 1, *shape, self.index_dim), dtype=dtype, device=device)
        return torch.zeros((len(self.owned) + 1, *shape, self.latent_dim), dtype=dtype, device=device)

    def latent(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s latent + rope keys when this rank owns it, else the latent scratch layer."""
        return self.pool[self.pool_index(layer, self.owned)]

    def index_keys(self, layer: int) -> torch.Tensor:
        """The indexer keys of an owned indexer layer, else the indexer-key scratch layer."""
        if not self.has_index_keys(layer):
            raise ValueError(f"layer {layer} reuses an earlier layer's top-k and keeps no indexer keys")
        return self.index_pool[self.pool_index(layer, self.owned_index)]

    def layer_pools(self, layer: int) -> list[torch.Tensor]:
        return [self.latent(layer)] + ([self.index_keys(layer)] if self.has_index_keys(layer) else [])
