"""GLM-5-Next's export, ``graphcp-glm5next/1``: the KDA hybrids' layout
(graphcp.model.kimi_linear.export: a KDA layer's ``conv`` and float32 ``recurrent``
states, an indexed layer's ``latent`` and, where it runs the indexer, ``index_key`` and
``index_gate``; no ``rope_key``: no RoPE) under its own name, so that ``load_kv`` builds
GLM-5-Next's transformers cache (its indexed layers keep the indexer rows:
``DynamicIndexedLayer``)."""

from __future__ import annotations

from typing import ClassVar

import torch

from graphcp.model.hybrid.export import LINEAR
from graphcp.model.kimi_linear.export import KdaExport, KdaMeta
from graphcp.model.kimi_linear.hf_cache import fill_cache

GLM5_FORMAT = "graphcp-glm5next/1"


class Glm5Meta(KdaMeta):
    FORMAT: ClassVar[str] = GLM5_FORMAT


def to_glm5_cache(export: KdaExport, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """The ``transformers.DynamicCache`` GLM-5-Next's text model keeps, holding ``export``:
    a ``DynamicIndexedLayer`` for each indexed layer, a ``LinearAttentionLayer`` for each
    KDA layer."""
    from transformers.cache_utils import DynamicCache, DynamicIndexedLayer, LinearAttentionLayer

    cache = DynamicCache()
    cache.layers = [LinearAttentionLayer() if k == LINEAR else DynamicIndexedLayer() for k in export.meta.layer_kinds]
    fill_cache(cache, export, device, dtype)
    return cache
