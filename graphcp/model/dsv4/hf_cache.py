"""The transformers cache of a DeepSeek V4 model's export (``graphcp-dsv4/1``,
graphcp.model.dsv4.export): what ``load_kv`` and the PD demo continue from (the format's
builder, registered with the format). transformers is imported when it is called."""

from __future__ import annotations

import torch

from graphcp.model.dsv4.cache import CSA, HCA, SLIDING
from graphcp.model.dsv4.export import DsV4Export


def to_dsv4_cache(export: DsV4Export, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """The ``transformers.DynamicCache`` a DeepSeek V4 model keeps, holding ``export``
    (batch of one): built as transformers builds it (``DynamicCache(config=...)`` of a
    ``DeepseekV4Config`` with the export's layer kinds, window and compress rates: a
    ``DynamicSlidingWindowLayer``, ``DeepseekV4CSACache`` or ``DeepseekV4HCACache`` a
    layer), then filled: the window as ``keys`` = ``values`` ``[1, 1, rows, head_dim]``
    with ``cumulative_length`` T; per compressor (``"compressor"``, CSA also
    ``"indexer"``) ``compressed_kv [1, n, width]``, ``entry_count`` n, ``buffer_kv`` /
    ``buffer_gate [1, r, series x width]`` and (CSA) ``overlap_kv`` / ``overlap_gate
    [1, m, width]`` (None below m tokens). ``dtype`` casts the model-dtype tensors; the
    overlap gates stay float32, as transformers keeps them."""
    import transformers
    import transformers.models.deepseek_v4.modeling_deepseek_v4  # noqa: F401 (registers V4's cache layers)
    from transformers import DynamicCache

    m = export.meta
    names = {SLIDING: "sliding_attention", CSA: "compressed_sparse_attention", HCA: "heavily_compressed_attention"}
    config = transformers.DeepseekV4Config(
        num_hidden_layers=m.num_layers, layer_types=[names[k] for k in m.layer_kinds], sliding_window=m.sliding_window,
        compress_rates={names[CSA]: m.compress_csa, names[HCA]: m.compress_hca})
    cache = DynamicCache(config=config)

    def put(t: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        return t.to(device=device, dtype=None if keep_dtype else dtype)[None]

    for i, layer in enumerate(cache.layers):
        t = export.layers[i]
        window = put(t["window"])[None]
        layer.update(window, window)
        layer.cumulative_length = m.num_tokens  # the window holds the last rows of T tokens
        if m.layer_kinds[i] == SLIDING:
            continue
        for name, prefix in (("compressor", ""), ("indexer", "index_")):
            if prefix + "compressed_kv" not in t:
                continue
            layer.compressed_kv[name] = put(t[prefix + "compressed_kv"])
            layer.entry_count[name] = m.entries(i)
            layer.buffer_kv[name] = put(t[prefix + "buffer_kv"])
            layer.buffer_gate[name] = put(t[prefix + "buffer_gate"])
            if m.layer_kinds[i] == CSA:
                has = prefix + "overlap_kv" in t
                layer.overlap_kv[name] = put(t[prefix + "overlap_kv"]) if has else None
                layer.overlap_gate[name] = put(t[prefix + "overlap_gate"], keep_dtype=True) if has else None
    return cache
