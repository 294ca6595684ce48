"""``graphcp.pd.load_kv``: a KV file as tensors, and as a transformers cache when
transformers is installed. It reads the formats registered (graphcp.pd.formats): a
family's own once its family is imported; ``from graphcp import load_kv`` imports every
built-in family first."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from graphcp.pd.files import read_kv
from graphcp.pd.formats import Export, kv_format
from graphcp.pd.hf import check_transformers


@dataclass
class LoadedKV:
    #: the tensors and metadata, in the file's format (graphcp-kv/1, or its family's own)
    export: Export
    #: the transformers cache a model of that format keeps (the format's builder:
    #: a DynamicCache of its kind of layers), or None without transformers
    cache: Any

    @property
    def num_tokens(self) -> int:
        return self.export.meta.num_tokens


def to_transformers_cache(export: Export, device: torch.device | str | None = None,
                          dtype: torch.dtype | None = None):
    """The transformers cache of an export of any registered format (its format's
    builder), for a transformers release :func:`graphcp.pd.hf.check_transformers` knows."""
    check_transformers()
    return kv_format(export.meta.format).transformers_cache(export, device, dtype)


def load_kv(path: str | os.PathLike, device: torch.device | str = "cpu") -> LoadedKV:
    """Read a file written by ``graphcp prefill --export-kv`` (graphcp.pd.files) with the
    cache transformers keeps for a model of its format (:func:`to_transformers_cache`)."""
    export = read_kv(path, device)
    cache = None
    if importlib.util.find_spec("transformers") is not None:
        cache = to_transformers_cache(export)
    return LoadedKV(export, cache)
