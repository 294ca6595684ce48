"""What sizes a cache: the pool (:class:`PoolSpec`: its pages, the layers it serves and
this rank's place among the CP ranks) and what a token holds in it (a family's
*geometry*, a :class:`CacheGeometry`: :class:`KVHeads` for K and V of the KV heads; a
family whose tokens hold something else defines its own in its folder).
:func:`graphcp.kv.factory.make_cache` builds a cache mode from the two."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcp.kv.layout import KVLayout


@dataclass(frozen=True)
class PoolSpec:
    """One rank's pool: ``layers`` are the global layers the cache serves (a pipeline
    stage's, and an EAGLE-3 draft's after them); ``max_pages_per_seq``: a request's
    page-table width; ``rank`` / ``cp_size``: this rank in its CP group."""

    layers: range
    num_pages: int
    page_size: int
    dtype: torch.dtype
    device: torch.device | str = "cpu"
    max_pages_per_seq: int | None = None
    rank: int = 0
    cp_size: int = 1


class CacheGeometry:
    """What a token holds in a cache: the type of every family's geometry (what
    ``ModelFamily.cache_geometry`` returns), a frozen dataclass of the sizes its storage
    allocates by. The factory builds the storage registered for the geometry's class
    (:func:`graphcp.kv.factory.register_storage`)."""

    __slots__ = ()


@dataclass(frozen=True)
class KVHeads(CacheGeometry):
    """A dense model's token: K and V of ``num_kv_heads`` heads of ``head_dim`` (this
    rank's heads under attention TP), pages laid out as the attention backend reads them."""

    num_kv_heads: int
    head_dim: int
    layout: KVLayout = "NHD"
