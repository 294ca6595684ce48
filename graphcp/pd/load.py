"""``graphcp.pd.load_kv``: a KV file as tensors, and as a transformers cache when
transformers is installed."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from graphcp.pd.dsv4_export import DsV4Export
from graphcp.pd.export import KVExport
from graphcp.pd.files import read_kv
from graphcp.pd.hf import to_transformers_cache
from graphcp.pd.hybrid_export import HybridExport
from graphcp.pd.mla_export import MlaExport


@dataclass
class LoadedKV:
    #: the tensors and metadata (graphcp-kv/1; graphcp-mla/1 for DSA models, graphcp-dsv4/1 for DeepSeek V4,
    #: graphcp-hybrid/1 for the linear-attention hybrids)
    export: KVExport | MlaExport | DsV4Export | HybridExport
    #: a transformers.DynamicCache (DSA models: of DynamicIndexedLayers; V4: its window / CSA / HCA layers;
    #: hybrids: linear-attention and full-attention layers), or None without transformers
    cache: Any

    @property
    def num_tokens(self) -> int:
        return self.export.meta.num_tokens


def load_kv(path: str | os.PathLike, device: torch.device | str = "cpu") -> LoadedKV:
    """Read a file written by ``graphcp prefill --export-kv`` (graphcp.pd.files): a
    DSA model's (graphcp-mla/1) with the cache transformers' DeepSeek V3.2 / GLM-5 keep, a
    DeepSeek V4 model's (graphcp-dsv4/1) with the cache transformers' V4 keeps, a hybrid's
    (graphcp-hybrid/1) with the cache transformers' Qwen3.5 / Qwen3-Next keep."""
    export = read_kv(path, device)
    cache = None
    if importlib.util.find_spec("transformers") is not None:
        cache = to_transformers_cache(export)
    return LoadedKV(export, cache)
