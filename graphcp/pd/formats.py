"""The export formats, by name: what a header's ``format`` stands for.

A format is its metadata class (a :class:`~graphcp.pd.layout.TensorLayout` read back
with ``from_dict(d, source)``), its export class and the builder of the transformers
cache a model of it keeps. ``graphcp-kv/1`` (K/V per layer, graphcp.pd.export) is
registered here; a model family whose cache holds something else registers its own
format from its folder (:func:`register_format`, called when the family's module is
imported). Files (graphcp.pd.files), the Mooncake receiver and ``load_kv`` look a
header's ``format`` up here.

The built-in families are registered when ``graphcp.model`` is imported (every engine
imports it); a program that only reads KV imports them with ``from graphcp import
load_kv`` (the public API imports the families first, docs/pd.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from graphcp.pd.export import FORMAT, KVExport, KVFormatError, KVMeta
from graphcp.pd.hf import to_dynamic_cache
from graphcp.pd.layout import TensorLayout

#: ``(export, device, dtype) -> the transformers cache``; it imports transformers itself
CacheBuilder = Callable[..., Any]


class Export(Protocol):
    """What every format's export offers the transports (its class is the format's)."""

    meta: Any  # the format's metadata (a TensorLayout with ``format`` and ``to_dict``)
    token_ids: torch.Tensor | None
    last_logits: torch.Tensor | None

    def tensor(self, layer: int, name: str) -> torch.Tensor: ...

    def check(self, source: str = ...) -> Any: ...


@dataclass(frozen=True)
class KVFormat:
    name: str
    meta: type[TensorLayout]  # with ``from_dict(d, source)``
    export: type  # what ``meta.make_export`` makes
    transformers_cache: CacheBuilder


_FORMATS: dict[str, KVFormat] = {}


def register_format(name: str, meta: type[TensorLayout], export: type, transformers_cache: CacheBuilder) -> KVFormat:
    """Make ``name`` (a header's ``format``) read as ``meta``, exported as ``export`` and
    continued by transformers from ``transformers_cache(export, device, dtype)``."""
    fmt = KVFormat(name, meta, export, transformers_cache)
    _FORMATS[name] = fmt
    return fmt


def registered() -> list[str]:
    """The format names registered so far, in order of registration."""
    return list(_FORMATS)


def kv_format(name: object, source: str = "KV metadata") -> KVFormat:
    """The format ``name``; KVFormatError naming ``source`` when none is registered by that name."""
    fmt = _FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise KVFormatError(f"{source}: format {name!r} is none of {registered()} (the formats registered; "
                            "importing graphcp.model registers every built-in family's)")
    return fmt


def meta_from_dict(d: dict, source: str = "KV metadata") -> TensorLayout:
    """The metadata of the format ``d["format"]`` names (graphcp-kv/1's when it names none,
    which then says what is missing); KVFormatError naming ``source`` otherwise."""
    if not isinstance(d, dict):
        raise KVFormatError(f"{source}: expected a mapping of metadata, got {type(d).__name__}")
    return kv_format(d.get("format", FORMAT), source).meta.from_dict(d, source)


register_format(FORMAT, KVMeta, KVExport, to_dynamic_cache)
