"""The transformers cache of a linear-attention hybrid's export (``graphcp-hybrid/1``,
graphcp.model.hybrid.export): what ``load_kv`` and the PD demo continue from (the format's
builder, registered with the format). transformers is imported when it is called."""

from __future__ import annotations

import torch

from graphcp.model.hybrid.export import FULL, HybridExport


def to_hybrid_cache(export: HybridExport, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """The ``transformers.DynamicCache`` a Qwen3.5 / Qwen3-Next model keeps, holding
    ``export`` (batch of one): built as transformers builds it (``DynamicCache(config=...)``
    of the export's layer types: a ``LinearAttentionLayer`` or a ``DynamicLayer`` a layer),
    then filled: a full layer's keys and values ``[1, heads, T, head_dim]``; a linear
    layer's conv state ``[1, conv_dim, K]`` and recurrent state ``[1, Hv, d_k, d_v]``
    (float32, as transformers keeps it; ``dtype`` casts the rest)."""
    import transformers
    from transformers import DynamicCache

    m = export.meta
    kinds = m.layer_kinds[: m.target_layers]  # (a draft's layers ride along: transformers' cache takes the model's)
    names = ["full_attention" if k == FULL else "linear_attention" for k in kinds]
    cache = DynamicCache(config=transformers.Qwen3_5TextConfig(num_hidden_layers=len(kinds), layer_types=names))

    def put(t: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        return t.to(device=device, dtype=None if keep_dtype else dtype)[None]

    for i, layer in enumerate(cache.layers):
        t = export.layers[i]
        if m.layer_kinds[i] == FULL:
            layer.update(put(t["k"]), put(t["v"]))
            continue
        layer.update_conv_state(put(t["conv"]), conv_kernel_size=m.conv_kernel)
        layer.update_recurrent_state(put(t["recurrent"], keep_dtype=True))
        _count_linear_tokens(layer, m.num_tokens)
    return cache


def _count_linear_tokens(layer, num_tokens: int) -> None:
    """transformers >= 5.25 counts a linear layer's tokens itself (``cumulative_length_linear``:
    what ``get_seq_length()`` returns, so the continuation's positions), and
    ``update_conv_state`` added the conv state's width to it, not the request's length.
    Earlier releases count the full layers' keys and keep no such counter."""
    count = getattr(layer, "cumulative_length_linear", None)
    if count is not None:
        count.fill_(num_tokens)
