"""The paged cache of a DSA model: MLA's latent and the indexer's keys.

Per layer and token MLA needs only what ``kv_a_proj_with_mqa`` produced: the
compressed latent (``kv_lora_rank`` values, after ``kv_a_layernorm``) and the rope
key shared by every head (``qk_rope_head_dim`` values, after RoPE). The cache holds
these ``latent_dim = kv_lora_rank + qk_rope_head_dim`` values a token, not per-head
K/V (H * (qk_nope + qk_rope + v) values: 71x more for DeepSeek V3.2); attention
decompresses the keys and values it reads (``graphcp/model/dsa/sparse.py``).
The rope key's pairs stay where RoPE rotated them (interleaved, as DeepSeek's own
inference code and the decode engines cache them; transformers' cache lists the
rotated pairs' first members, then the second ones: the same values, permuted).

Beside it, for every layer that runs the indexer, the indexer's key of each token
(``index_head_dim`` values, after LayerNorm and RoPE), scored against later queries
(GLM's interleaved indexer RoPE: its pairs in place too, a permutation of transformers').

Pools, pages along dim 1 as in :class:`PagedKVCache` (same allocator, page tables,
slots and handles; page 0 is scratch):

- ``pool``: ``[num_layers, num_pages, page_size, latent_dim]``;
- ``index_pool``: ``[num_indexer_layers, num_pages, page_size, index_head_dim]``.

The forward reads a layer through :meth:`latent` and :meth:`index_keys` only: the
layer split of these caches (graphcp.model.dsa.layer_split) overrides them. A PD export
reads :meth:`read_span` (graphcp.model.dsa.export).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcp.kv.paged import KVHandle, PagedKVCache
from graphcp.kv.spans import KVSpan
from graphcp.kv.spec import PoolSpec


@dataclass(frozen=True)
class MlaGeometry:
    """A DSA model's token: its latent and rope key (``kv_lora_rank + rope_dim``) in every
    layer, and its indexer key (``index_dim``) in the layers that run the indexer
    (``indexer_layers``: the model's, one entry a layer)."""

    kv_lora_rank: int
    rope_dim: int
    index_dim: int
    indexer_layers: tuple[bool, ...]

    def indexer_of(self, layers: range) -> tuple[bool, ...]:
        return self.indexer_layers[layers.start:layers.stop]


class MlaKVCache(PagedKVCache):
    @classmethod
    def create(cls, geometry: MlaGeometry, pool: PoolSpec) -> "MlaKVCache":
        return cls(*cls._args(geometry, pool), first_layer=pool.layers.start)

    @staticmethod
    def _args(g: MlaGeometry, pool: PoolSpec) -> tuple:
        return (len(pool.layers), pool.num_pages, pool.page_size, g.kv_lora_rank, g.rope_dim, g.index_dim,
                g.indexer_of(pool.layers), pool.dtype, pool.device, pool.max_pages_per_seq)

    @classmethod
    def held_layers_of(cls, geometry: MlaGeometry, pool: PoolSpec) -> tuple[int, int]:
        """(latent layers, indexer-key layers) a rank's pools hold."""
        indexer = geometry.indexer_of(pool.layers)
        return len(indexer), sum(indexer)

    @classmethod
    def pool_bytes_for(cls, geometry: MlaGeometry, pool: PoolSpec) -> int:
        held, index_held = cls.held_layers_of(geometry, pool)
        itemsize = torch.empty(0, dtype=pool.dtype).element_size()
        return pool.num_pages * cls.bytes_per_page(held, pool.page_size, geometry.kv_lora_rank + geometry.rope_dim,
                                                   geometry.index_dim, index_held, itemsize)

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_lora_rank: int,
        rope_dim: int,
        index_dim: int,
        indexer_layers: tuple[bool, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        max_pages_per_seq: int | None = None,
        first_layer: int = 0,
    ) -> None:
        """``num_layers`` from global layer ``first_layer`` on (a pipeline stage's, or the
        model's); ``indexer_layers``: which of them run the indexer."""
        if len(indexer_layers) != num_layers:
            raise ValueError(f"indexer_layers has {len(indexer_layers)} entries for {num_layers} layers")
        self.kv_lora_rank, self.rope_dim, self.index_dim = kv_lora_rank, rope_dim, index_dim
        #: global layer -> its slot of index_pool (layers that run the indexer only)
        self.index_slot = {first_layer + i: j
                           for j, i in enumerate(i for i, full in enumerate(indexer_layers) if full)}
        # the base class's "one head of latent_dim" is what a token holds: its bookkeeping fits
        super().__init__(num_layers, num_pages, page_size, 1, kv_lora_rank + rope_dim, dtype, device, "NHD",
                         max_pages_per_seq, first_layer)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, latent_dim: int, index_dim: int, num_indexer_layers: int,
                       itemsize: int) -> int:
        """Bytes one page takes in both pools (the engine checks the pool fits memory)."""
        return page_size * (num_layers * latent_dim + num_indexer_layers * index_dim) * itemsize

    def _allocate_pool(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        self.index_pool = torch.zeros((len(self.index_slot), self.num_pages, self.page_size, self.index_dim),
                                      dtype=dtype, device=device)
        return torch.zeros((self.num_layers, self.num_pages, self.page_size, self.latent_dim), dtype=dtype,
                           device=device)

    def page_pools(self) -> dict[str, torch.Tensor]:
        return {"latent_cache": self.pool, "index_key_cache": self.index_pool}

    def token_values(self, layer: int) -> int:
        return self.latent_dim + (self.index_dim if self.has_index_keys(layer) else 0)

    def latent(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, latent_dim]``: layer ``layer``'s latent + rope keys."""
        return self.pool[self.local_layer(layer)]

    def layer(self, i: int) -> torch.Tensor:
        return self.latent(i)

    def has_index_keys(self, layer: int) -> bool:
        return layer in self.index_slot

    def index_keys(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, index_dim]``: the indexer keys of a layer that runs it."""
        slot = self.index_slot.get(layer)
        if slot is None:
            raise ValueError(f"layer {layer} reuses an earlier layer's top-k and keeps no indexer keys")
        return self.index_pool[slot]

    def write(self, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Scatter ``rows [n, latent_dim (+ index_dim)]`` (latent, rope key, and the
        indexer key where this layer keeps one) to ``slots [n]``; slot -1 (padding)
        goes to the scratch page, so the write keeps a static shape."""
        s = slots.clamp(min=0)
        page, off = torch.div(s, self.page_size, rounding_mode="floor"), s % self.page_size
        self.latent(layer)[page, off] = rows[:, : self.latent_dim]
        if self.has_index_keys(layer):
            self.index_keys(layer)[page, off] = rows[:, self.latent_dim:]

    def read_span(self, handle: KVHandle, span: KVSpan) -> tuple[torch.Tensor, ...]:
        """``handle``'s positions ``[span.start, span.stop)`` of one layer (new
        contiguous tensors, tokens along dim 0): ``latent [n, kv_lora_rank]``, ``rope_key
        [n, rope_dim]`` (pairs interleaved, as cached) and, where the layer runs the
        indexer, ``index_key [n, index_dim]`` (graphcp.model.dsa.export's per-layer tensors)."""
        self.check_handle(handle)
        ps = self.page_size
        first, last = span.start // ps, self.pages_for(span.stop)
        pages = torch.tensor(handle.pages[first:last], dtype=torch.long, device=self.pool.device)
        lo, hi = span.start - first * ps, span.stop - first * ps
        lat = self.latent(span.layer).index_select(0, pages).flatten(0, 1)[lo:hi]
        out = (lat[:, : self.kv_lora_rank].contiguous(), lat[:, self.kv_lora_rank:].contiguous())
        if self.has_index_keys(span.layer):
            out += (self.index_keys(span.layer).index_select(0, pages).flatten(0, 1)[lo:hi].contiguous(),)
        return out

    def read_tokens(self, handle: KVHandle, layer: int) -> dict[str, torch.Tensor]:
        """One request's cached tokens of one layer, as a decode engine of these models
        needs them (new tensors): ``latent [T, kv_lora_rank]``, ``rope_key [T,
        qk_rope_head_dim]`` (pairs interleaved) and, where the layer runs the indexer,
        ``index_key [T, index_head_dim]``."""
        parts = self.read_span(handle, KVSpan(layer, 0, handle.num_tokens, 0))
        return dict(zip(("latent", "rope_key", "index_key"), parts))
