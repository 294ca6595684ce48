"""The transformers cache of a KDA hybrid's export (graphcp.model.kimi_linear.export):
what ``load_kv`` and the PD demo continue from (the format's builder, registered with
the format). transformers is imported when it is called."""

from __future__ import annotations

import torch

from graphcp.model.hybrid.export import LINEAR
from graphcp.model.kimi_linear.export import KdaExport


def fill_cache(cache, export: KdaExport, device=None, dtype: torch.dtype | None = None) -> None:
    """Fill ``cache`` (a ``DynamicCache`` whose layers are built: a linear-attention layer
    for each KDA layer) from ``export``, batch of one: an MLA layer's keys ``[1, 1, T,
    kv_lora_rank]`` (the latent) and values ``[1, 1, T, rope_dim]`` (the rope slice), and
    with an indexer its ``indexer_keys`` ``[1, T, 2 index_dim + 1]`` (key, gate and the
    validity column transformers packs); a KDA layer's conv state ``[1, 3 H d, K]`` and
    float32 recurrent state ``[1, H, d, d]``. ``dtype`` casts all but the recurrent state."""
    m = export.meta

    def put(t: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        return t.to(device=device, dtype=None if keep_dtype else dtype)[None]

    for i, layer in enumerate(cache.layers):
        t = export.layers[i]
        if m.layer_kinds[i] == LINEAR:
            layer.update_conv_state(put(t["conv"]), conv_kernel_size=m.conv_kernel)
            layer.update_recurrent_state(put(t["recurrent"], keep_dtype=True))
            count = getattr(layer, "cumulative_length_linear", None)  # (update_conv_state counted K, not T)
            if count is not None:
                count.fill_(m.num_tokens)
            continue
        latent = put(t["latent"])
        rope = put(t["rope_key"]) if "rope_key" in t else latent.new_zeros(1, latent.shape[1], 0)
        cache.update(latent[None], rope[None], i)
        if "index_key" in t:
            valid = torch.ones(m.num_tokens, 1, dtype=t["index_key"].dtype)
            cache.update_indexer(put(torch.cat([t["index_key"], t["index_gate"], valid], dim=-1)), i)


def to_kda_cache(export: KdaExport, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """The ``transformers.DynamicCache`` a Kimi Linear model keeps, holding ``export``: a
    ``DynamicLayer`` for each MLA layer, a ``LinearAttentionLayer`` for each KDA layer."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

    cache = DynamicCache()
    cache.layers = [LinearAttentionLayer() if k == LINEAR else DynamicLayer() for k in export.meta.layer_kinds]
    fill_cache(cache, export, device, dtype)
    return cache
