"""The transformers cache of a DSA model's export (``graphcp-mla/1``,
graphcp.model.dsa.export): what ``load_kv`` and the PD demo continue from (the format's
builder, registered with the format). transformers is imported when it is called."""

from __future__ import annotations

import torch

from graphcp.model.dsa.export import MlaExport, interleaved_to_half_split


def to_mla_cache(export: MlaExport, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """The ``transformers.DynamicCache`` a DeepSeek V3.2 / GLM-5 model (transformers 5)
    keeps, holding ``export`` (batch of one): per layer a ``DynamicIndexedLayer`` (every
    layer of these models is ``indexed_attention``) with ``keys [1, 1, T, kv_lora_rank]``
    (the latent), ``values [1, 1, T, rope_dim]`` (the rope key in transformers' pair
    order) and, for the indexer layers, ``indexer_keys [1, T, index_dim]`` (GLM's rope
    dims in transformers' order too). A "shared" layer's indexer keys stay unset, as
    after transformers' own forward."""
    from transformers.cache_utils import DynamicCache, DynamicIndexedLayer

    m = export.meta
    cache = DynamicCache()
    cache.layers = [DynamicIndexedLayer() for _ in range(m.num_layers)]

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype) if device is not None or dtype is not None else t

    for i in range(m.num_layers):
        t = export.layers[i]
        cache.update(put(t["latent"])[None, None], put(interleaved_to_half_split(t["rope_key"]))[None, None], i)
        if "index_key" in t:
            key = interleaved_to_half_split(t["index_key"], m.rope_dim) if m.index_rope_interleaved else t["index_key"]
            cache.update_indexer(put(key)[None], i)
    return cache
