"""The transformers side of a KV export, so a transformers model continues a request
graphcp prefilled (the decode side of the file transport, and the reference the
continuation tests use): the releases whose caches graphcp builds
(:func:`check_transformers`), graphcp-kv/1's cache (:func:`to_dynamic_cache`), the
forward's cache argument and the greedy loop. A format of a family's own registers its
cache's builder with the format (graphcp.pd.formats); ``graphcp.pd.load`` picks it.
transformers is imported only when a function needs it: graphcp does not need it.

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

#: the transformers releases (major, minor) whose caches this module builds and whose
#: continuation from them was checked; ``scripts/check_latest.sh`` tells what a newer one moved
KNOWN_TRANSFORMERS = ((5, 24), (5, 25))


class UnknownTransformers(GraphcpError, RuntimeError):
    """The installed transformers is not a release whose caches graphcp knows how to build."""


def check_transformers(version: str | None = None) -> None:
    """Raise :class:`UnknownTransformers` unless ``version`` (default: the installed
    transformers') is within :data:`KNOWN_TRANSFORMERS`: a cache built for another
    release may continue at the wrong positions, silently (transformers 5.25 moved where a
    linear-attention layer's cache counts its tokens)."""
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
