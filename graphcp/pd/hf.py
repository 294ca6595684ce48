"""A transformers cache from a KV export, so a transformers model continues a request
graphcp prefilled (the decode side of the file transport, and the reference the
continuation tests use). transformers is imported here only: graphcp does not need it.

transformers' ``DynamicCache`` holds per layer ``[batch, num_kv_heads, seq, head_dim]``
keys after RoPE: the export's layout with a batch dimension. The cache is built with
``DynamicCache.update(k, v, layer)``, which every release since 4.36 keeps (the
constructor arguments and ``from_legacy_cache`` changed across 4.x and 5.x).
transformers 5 renamed the forward's ``past_key_values`` argument to ``cache``:
:func:`cache_argument` says which one a model takes.
"""

from __future__ import annotations

import inspect

import torch

from graphcp.pd.export import KVExport


def to_dynamic_cache(export: KVExport, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """A ``transformers.DynamicCache`` holding ``export`` (batch of one)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i in range(export.meta.num_layers):
        k, v = export.k[i], export.v[i]
        if device is not None or dtype is not None:
            k, v = k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)
        cache.update(k.unsqueeze(0), v.unsqueeze(0), i)
    return cache


def cache_argument(model) -> str:
    """The forward argument that takes a cache: ``cache`` (transformers 5) or
    ``past_key_values`` (4.x)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.inference_mode()
def greedy_continue(model, cache, next_token: int, steps: int) -> tuple[list[int], torch.Tensor]:
    """Feed ``next_token`` and then each argmax for ``steps`` forwards, extending
    ``cache`` in place; returns the ``steps`` greedy tokens and the first forward's
    float32 logits ``[vocab]`` (the logits after ``next_token``)."""
    arg = cache_argument(model)
    tokens: list[int] = []
    first = None
    tok = next_token
    device = next(model.parameters()).device
    for _ in range(steps):
        out = model(input_ids=torch.tensor([[tok]], device=device), use_cache=True, **{arg: cache})
        logits = out.logits[0, -1].float()
        if first is None:
            first = logits
        tok = int(logits.argmax())
        tokens.append(tok)
    return tokens, first
