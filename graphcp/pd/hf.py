"""A transformers cache from a KV export (any format), so a transformers model continues a request
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
import re

import torch

from graphcp.errors import GraphcpError
from graphcp.pd.export import KVExport
from graphcp.pd.hybrid_export import FULL, HybridExport

#: the transformers releases (major, minor) whose caches this module builds and whose
#: continuation from them was checked; ``scripts/check_latest.sh`` tells what a newer one moved
KNOWN_TRANSFORMERS = ((5, 24), (5, 25))


class UnknownTransformers(GraphcpError, RuntimeError):
    """The installed transformers is not a release whose caches graphcp knows how to build."""


def check_transformers(version: str | None = None) -> None:
    """Raise :class:`UnknownTransformers` unless ``version`` (default: the installed
    transformers') is within :data:`KNOWN_TRANSFORMERS`: a cache built for another
    release may continue at the wrong positions, silently (transformers 5.25 moved where a
    hybrid's cache counts its tokens)."""
    if version is None:
        import transformers

        version = transformers.__version__
    parts = re.match(r"(\d+)\.(\d+)", version)
    (lo, hi) = KNOWN_TRANSFORMERS
    if parts is None or not lo <= (int(parts[1]), int(parts[2])) <= hi:
        raise UnknownTransformers(
            f"transformers {version} is not a release graphcp's KV loader knows (it knows {lo[0]}.{lo[1]} to "
            f"{hi[0]}.{hi[1]}): pip install \"transformers>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}\"")


def to_dynamic_cache(export: KVExport, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """A ``transformers.DynamicCache`` holding ``export``'s target layers (batch of one)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i in range(export.meta.target_layers):  # a draft's layer is not the target's
        k, v = export.k[i], export.v[i]
        if device is not None or dtype is not None:
            k, v = k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)
        cache.update(k.unsqueeze(0), v.unsqueeze(0), i)
    return cache


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
    names = ["full_attention" if k == FULL else "linear_attention" for k in m.layer_kinds]
    cache = DynamicCache(config=transformers.Qwen3_5TextConfig(num_hidden_layers=m.num_layers, layer_types=names))

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
