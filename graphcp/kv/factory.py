"""The one factory of KV caches: a cache mode (``RuntimeConfig.kv_cache``) and a
family's geometry (what a token holds) pick the cache class, and every cache is built,
sized and estimated through it.

Each cache class is a cache mode's object: it owns the reservation and rollback, the
per-layer exchange and store, the prefix fetch, and what a layer calls to attend (see
:class:`graphcp.kv.paged.PagedKVCache`). A new family with a cache of its own registers
its classes (:func:`register_cache`); a mode a geometry has no class for is refused
with the options that do not combine (graphcp/combinations.py) before it gets here.
"""

from __future__ import annotations

from graphcp.kv.layer_split import LayerSplitKVCache
from graphcp.kv.paged import PagedKVCache
from graphcp.kv.sharded import ShardedKVCache
from graphcp.kv.spec import KVHeads, PoolSpec

_CACHES: dict[tuple[type, str], type[PagedKVCache]] = {
    (KVHeads, "replicated"): PagedKVCache,
    (KVHeads, "sharded"): ShardedKVCache,
    (KVHeads, "layer-split"): LayerSplitKVCache,
}


def register_cache(geometry: type, mode: str, cls: type[PagedKVCache]) -> None:
    """Make ``cls`` the cache of ``mode`` for tokens of ``geometry`` (a new family's)."""
    _CACHES[(geometry, mode)] = cls


def cache_class(mode: str, geometry: object) -> type[PagedKVCache]:
    """The class of cache mode ``mode`` for ``geometry``; ValueError when there is none."""
    cls = _CACHES.get((type(geometry), mode))
    if cls is None:
        modes = sorted(m for g, m in _CACHES if g is type(geometry))
        raise ValueError(f"no {mode!r} KV cache for {type(geometry).__name__} tokens; this model's caches: {modes}")
    return cls


def make_cache(mode: str, geometry: object, pool: PoolSpec) -> PagedKVCache:
    """This rank's cache of ``mode`` holding ``geometry``'s tokens in ``pool``."""
    return cache_class(mode, geometry).create(geometry, pool)


def pool_bytes(mode: str, geometry: object, pool: PoolSpec) -> int:
    """Bytes of rank ``pool.rank``'s page pools (what :func:`make_cache` would allocate)."""
    return cache_class(mode, geometry).pool_bytes_for(geometry, pool)


def capture_bytes(mode: str, geometry: object, pool_bytes: int, num_layers: int, exchange: str) -> int:
    """What capturing the buckets reserves besides a pool of ``pool_bytes`` for
    ``num_layers`` layers (the ring's staging buffers of a sharded cache)."""
    return cache_class(mode, geometry).capture_bytes_for(pool_bytes, num_layers, exchange)
