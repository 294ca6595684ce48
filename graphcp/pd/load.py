"""``graphcp.pd.load_kv``: a KV file as tensors, and as a transformers cache when
transformers is installed."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from graphcp.pd.export import KVExport
from graphcp.pd.files import read_kv
from graphcp.pd.hf import to_dynamic_cache


@dataclass
class LoadedKV:
    export: KVExport  # the tensors and metadata
    cache: Any  # a transformers.DynamicCache, or None without transformers

    @property
    def num_tokens(self) -> int:
        return self.export.meta.num_tokens


def load_kv(path: str | os.PathLike, device: torch.device | str = "cpu") -> LoadedKV:
    """Read a file written by ``graphcp prefill --export-kv`` (graphcp.pd.files)."""
    export = read_kv(path, device)
    cache = to_dynamic_cache(export) if importlib.util.find_spec("transformers") is not None else None
    return LoadedKV(export, cache)
