"""How large a rank's KV pool is: its pages (``RuntimeConfig.kv_tokens``, or the
default) and its bytes for the cache mode. The engine allocates by these and refuses
a pool larger than the device; the commands estimate a rank's memory with them
before launching ranks (graphcp.jobs.memory)."""

from __future__ import annotations

from graphcp.config import RuntimeConfig
from graphcp.kv import factory
from graphcp.kv.spec import PoolSpec
from graphcp.model.config import ModelConfig
from graphcp.model.family import family_of

#: the default pool: 4 contexts of the model, at most 64K tokens
DEFAULT_POOL_TOKENS = 1 << 16


def pool_pages(rt: RuntimeConfig, cfg: ModelConfig) -> int:
    """Pages of a rank's pool: ``kv_tokens`` (default: 4 contexts, at most 64K tokens)
    rounded up to pages, plus the scratch page."""
    kv_tokens = rt.kv_tokens if rt.kv_tokens is not None else min(4 * cfg.max_position_embeddings,
                                                                  DEFAULT_POOL_TOKENS)
    return -(-kv_tokens // rt.page_size) + 1


def pool_spec(rt: RuntimeConfig, num_pages: int, layers: range, rank: int, cp_size: int,
              max_pages_per_seq: int | None = None, device="cpu") -> PoolSpec:
    return PoolSpec(layers, num_pages, rt.page_size, rt.torch_dtype, device, max_pages_per_seq, rank, cp_size)


def pool_bytes(cfg: ModelConfig, rt: RuntimeConfig, num_pages: int, layers: range, rank: int,
               cp_size: int) -> int:
    """Bytes of rank ``rank``'s pool of ``num_pages`` pages for ``layers`` (its pipeline
    stage's) in the cache mode ``rt.kv_cache`` (layer-split: its own of them and one
    scratch layer); ``cfg``: the config with this rank's heads."""
    geometry = family_of(cfg).cache_geometry(cfg, rt)
    return factory.pool_bytes(rt.kv_cache, geometry, pool_spec(rt, num_pages, layers, rank, cp_size))


def capture_bytes(cfg: ModelConfig, rt: RuntimeConfig, pool_bytes: int, num_layers: int) -> int:
    """What capturing the buckets reserves besides a pool of ``pool_bytes`` for
    ``num_layers`` layers in the cache mode ``rt.kv_cache`` (the ring's staging buffers of
    a sharded cache); ``cfg``: the config with this rank's heads."""
    geometry = family_of(cfg).cache_geometry(cfg, rt)
    return factory.capture_bytes(rt.kv_cache, geometry, pool_bytes, num_layers, rt.exchange)
