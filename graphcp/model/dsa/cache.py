"""The storage of a DSA model's cache: MLA's latent and the indexer's keys.

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

Pools, pages along dim 1 (page 0 is scratch; the allocator, page tables, slots and
handles are every cache's, graphcp.kv):

- ``pool``: ``[latent layers, num_pages, page_size, latent_dim]``;
- ``index_pool``: ``[indexer-key layers, num_pages, page_size, index_head_dim]``.

The layers are those this rank keeps (graphcp.kv.layers): every layer it serves
(replicated), or under the layer split its own, and one scratch layer in each pool that
the others are written to. In the attention break (``run_sparse_mla``) a layer's owner
broadcasts the batch's cached-prefix pages of that layer, latent and indexer keys in one
message, before the indexer scores and the sparse attention read them: the same values
as the replicated cache, so the logits are bitwise the replicated engine's. A GLM
"shared" layer keeps no indexer keys (it reuses the last indexer layer's selection), so
only its latent is fetched.

The forward reads a layer through :meth:`MlaStorage.latent` and
:meth:`MlaStorage.index_keys`; a PD export reads the cache's ``read_span``
(graphcp.model.dsa.export).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcp.kv.handle import KVHandle
from graphcp.kv.layers import HeldLayers, LayerSlots
from graphcp.kv.spec import CacheGeometry, PoolSpec
from graphcp.kv.storage.base import Storage, itemsize


@dataclass(frozen=True)
class MlaGeometry(CacheGeometry):
    """A DSA model's token: its latent and rope key (``kv_lora_rank + rope_dim``) in every
    layer, and its indexer key (``index_dim``) in the layers that run the indexer
    (``indexer_layers``: the model's, one entry a layer)."""

    kv_lora_rank: int
    rope_dim: int
    index_dim: int
    indexer_layers: tuple[bool, ...]

    def indexer_of(self, layers: range) -> tuple[bool, ...]:
        return self.indexer_layers[layers.start:layers.stop]

    def slots(self, pool: PoolSpec, held: HeldLayers) -> tuple[LayerSlots, LayerSlots]:
        """Where each layer lives in the latent pool and in the indexer-key pool."""
        indexer = self.indexer_of(pool.layers)
        if len(indexer) != len(pool.layers):
            raise ValueError(f"indexer_layers has {len(indexer)} entries for {len(pool.layers)} layers")
        index_layers = [i for i, full in zip(pool.layers, indexer) if full]
        return LayerSlots(held), LayerSlots(held, index_layers, what=_NO_INDEX_KEYS)


_NO_INDEX_KEYS = "reuses an earlier layer's top-k and keeps no indexer keys"


class MlaStorage(Storage):
    modes = ("replicated", "layer-split")

    def __init__(self, geometry: MlaGeometry, pool: PoolSpec, held: HeldLayers) -> None:
        self.kv_lora_rank, self.rope_dim, self.index_dim = geometry.kv_lora_rank, geometry.rope_dim, geometry.index_dim
        self.num_pages, self.page_size, self.held = pool.num_pages, pool.page_size, held
        self.latent_slots, self.index_slots = geometry.slots(pool, held)
        #: the served layers that run the indexer (a GLM "shared" layer does not)
        self.indexer = frozenset(i for i, full in zip(pool.layers, geometry.indexer_of(pool.layers)) if full)
        shape = (pool.num_pages, pool.page_size)
        self.pool = torch.zeros((self.latent_slots.depth, *shape, self.latent_dim), dtype=pool.dtype,
                                device=pool.device)
        self.index_pool = torch.zeros((self.index_slots.depth, *shape, self.index_dim), dtype=pool.dtype,
                                      device=pool.device)

    @classmethod
    def create(cls, geometry: MlaGeometry, pool: PoolSpec, held: HeldLayers) -> "MlaStorage":
        return cls(geometry, pool, held)

    @classmethod
    def pool_bytes(cls, geometry: MlaGeometry, pool: PoolSpec, held: HeldLayers) -> int:
        latent, index = geometry.slots(pool, held)
        values = latent.depth * (geometry.kv_lora_rank + geometry.rope_dim) + index.depth * geometry.index_dim
        return pool.num_pages * pool.page_size * values * itemsize(pool.dtype)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def page_pools(self) -> dict[str, torch.Tensor]:
        return {"latent_cache": self.pool, "index_key_cache": self.index_pool}

    def token_values(self, layer: int) -> int:
        return self.latent_dim + (self.index_dim if self.has_index_keys(layer) else 0)

    def latent(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, latent_dim]``: layer ``layer``'s latent + rope keys
        (under the layer split: its own, or the scratch layer)."""
        return self.pool[self.latent_slots[layer]]

    def layer(self, i: int) -> torch.Tensor:
        return self.latent(i)

    def has_index_keys(self, layer: int) -> bool:
        return layer in self.indexer

    def index_keys(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, index_dim]``: the indexer keys of a layer that runs it."""
        if layer not in self.indexer:
            raise ValueError(f"layer {layer} {_NO_INDEX_KEYS}")
        return self.index_pool[self.index_slots[layer]]

    def layer_pools(self, layer: int) -> list[torch.Tensor]:
        return [self.latent(layer)] + ([self.index_keys(layer)] if self.has_index_keys(layer) else [])

    def write(self, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Scatter ``rows [n, latent_dim (+ index_dim)]`` (latent, rope key, and the
        indexer key where this layer keeps one) to ``slots [n]``; slot -1 (padding)
        goes to the scratch page, so the write keeps a static shape."""
        s = slots.clamp(min=0)
        page, off = torch.div(s, self.page_size, rounding_mode="floor"), s % self.page_size
        self.latent(layer)[page, off] = rows[:, : self.latent_dim]
        if self.has_index_keys(layer):
            self.index_keys(layer)[page, off] = rows[:, self.latent_dim:]

    def read_span(self, pages: tuple[int, ...], layer: int, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """Positions ``[start, stop)`` of one layer (new contiguous tensors, tokens along
        dim 0): ``latent [n, kv_lora_rank]``, ``rope_key [n, rope_dim]`` (pairs
        interleaved, as cached) and, where the layer runs the indexer, ``index_key [n,
        index_dim]`` (graphcp.model.dsa.export's per-layer tensors)."""
        ps = self.page_size
        first, last = start // ps, -(-stop // ps)
        index = torch.tensor(pages[first:last], dtype=torch.long, device=self.pool.device)
        lo, hi = start - first * ps, stop - first * ps
        lat = self.latent(layer).index_select(0, index).flatten(0, 1)[lo:hi]
        out = (lat[:, : self.kv_lora_rank].contiguous(), lat[:, self.kv_lora_rank:].contiguous())
        if self.has_index_keys(layer):
            out += (self.index_keys(layer).index_select(0, index).flatten(0, 1)[lo:hi].contiguous(),)
        return out

    def write_span(self, layer: int, values: tuple[torch.Tensor, ...], slots: torch.Tensor) -> None:
        """``latent``, ``rope_key`` (and ``index_key``), ``[n, ...]`` each in
        graphcp-mla/1's order (what :meth:`read_span` returns), at ``slots``."""
        self.write(layer, torch.cat(values, dim=1), slots)

    def read_tokens(self, handle: KVHandle, layer: int) -> dict[str, torch.Tensor]:
        """One request's cached tokens of one layer (a live handle of this cache's: the
        caller checks it), as a decode engine of these models needs them (new tensors):
        ``latent [T, kv_lora_rank]``, ``rope_key [T, qk_rope_head_dim]`` (pairs
        interleaved) and, where the layer runs the indexer, ``index_key [T, index_head_dim]``."""
        parts = self.read_span(handle.pages, layer, 0, handle.num_tokens)
        return dict(zip(("latent", "rope_key", "index_key"), parts))
