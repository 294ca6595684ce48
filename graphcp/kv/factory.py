"""The one factory of KV caches: a cache mode (``RuntimeConfig.kv_cache``) picks the
placement, a family's geometry (what a token holds: graphcp.kv.spec) picks the storage,
and every cache is built, sized and estimated from the two (graphcp.kv.paged).

A new mode is one placement (graphcp.kv.placement) named in :data:`PLACEMENTS`; a new
geometry is one storage, which a family registers from its folder
(:func:`register_storage`). A mode a geometry's storage is not built for is refused with
the options that do not combine (graphcp/combinations.py) before it gets here.
"""

from __future__ import annotations

from graphcp.kv.allocator import PageAllocator
from graphcp.kv.paged import PagedKVCache
from graphcp.kv.placement.base import Placement
from graphcp.kv.placement.layer_split import LayerSplitPlacement
from graphcp.kv.placement.replicated import ReplicatedPlacement
from graphcp.kv.placement.sharded import ShardedPlacement
from graphcp.kv.spec import CacheGeometry, KVHeads, PoolSpec
from graphcp.kv.storage.base import Storage
from graphcp.kv.storage.kv_heads import KVHeadsStorage

#: cache mode -> its placement
PLACEMENTS: dict[str, type[Placement]] = {p.mode: p for p in (ReplicatedPlacement, ShardedPlacement,
                                                              LayerSplitPlacement)}
_STORAGES: dict[type[CacheGeometry], type[Storage]] = {KVHeads: KVHeadsStorage}


def register_storage(geometry: type[CacheGeometry], storage: type[Storage]) -> None:
    """Make ``storage`` what a cache keeps for tokens of ``geometry`` (a family's), in
    every mode of ``storage.modes``."""
    _STORAGES[geometry] = storage


def parts(mode: str, geometry: CacheGeometry) -> tuple[type[Placement], type[Storage]]:
    """The placement of ``mode`` and the storage of ``geometry``; ValueError when the
    storage is not built for the mode (or either is unknown)."""
    storage = _STORAGES.get(type(geometry))
    if storage is None or mode not in storage.modes or mode not in PLACEMENTS:
        modes = sorted(m for m in PLACEMENTS if storage is not None and m in storage.modes)
        raise ValueError(f"no {mode!r} KV cache for {type(geometry).__name__} tokens; this model's caches: {modes}")
    return PLACEMENTS[mode], storage


def make_cache(mode: str, geometry: CacheGeometry, pool: PoolSpec) -> PagedKVCache:
    """This rank's cache of ``mode`` holding ``geometry``'s tokens in ``pool``."""
    placement, storage = parts(mode, geometry)
    allocator = PageAllocator(pool.num_pages, pool.page_size, pool.max_pages_per_seq)
    return PagedKVCache(allocator, placement(allocator, pool),
                        storage.create(geometry, pool, placement.held_layers(pool)))


def pool_bytes(mode: str, geometry: CacheGeometry, pool: PoolSpec) -> int:
    """Bytes of rank ``pool.rank``'s pools (what :func:`make_cache` would allocate)."""
    placement, storage = parts(mode, geometry)
    return storage.pool_bytes(geometry, pool, placement.held_layers(pool))


def capture_bytes(mode: str, geometry: CacheGeometry, pool_bytes: int, num_layers: int, exchange: str) -> int:
    """What capturing the buckets reserves besides a pool of ``pool_bytes`` for
    ``num_layers`` layers (the ring's staging buffers of a sharded cache)."""
    return parts(mode, geometry)[0].capture_bytes(pool_bytes, num_layers, exchange)
