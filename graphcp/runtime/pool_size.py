"""How large a rank's KV pool is: its pages (``RuntimeConfig.kv_tokens``, or the
default) and its bytes for the cache mode. The engine allocates by these and refuses
a pool larger than the device; the commands estimate a rank's memory with them
before launching ranks (graphcp.jobs.memory)."""

from __future__ import annotations

from graphcp.config import RuntimeConfig
from graphcp.kv.layer_split import pool_layers
from graphcp.model.config import ModelConfig
from graphcp.model.dsa import runtime as dsa_runtime
from graphcp.model.dsv4 import runtime as dsv4_runtime

#: the default pool: 4 contexts of the model, at most 64K tokens
DEFAULT_POOL_TOKENS = 1 << 16


def pool_pages(rt: RuntimeConfig, cfg: ModelConfig) -> int:
    """Pages of a rank's pool: ``kv_tokens`` (default: 4 contexts, at most 64K tokens)
    rounded up to pages, plus the scratch page."""
    kv_tokens = rt.kv_tokens if rt.kv_tokens is not None else min(4 * cfg.max_position_embeddings,
                                                                  DEFAULT_POOL_TOKENS)
    return -(-kv_tokens // rt.page_size) + 1


def pool_bytes(cfg: ModelConfig, rt: RuntimeConfig, num_pages: int, layers: range, rank: int,
               cp_size: int) -> int:
    """Bytes of rank ``rank``'s pool of ``num_pages`` pages for ``layers`` (its pipeline
    stage's), or under ``layer-split`` its own of them and one scratch layer."""
    if cfg.dsv4 is not None:  # replicated or layer-split (the sharded cache is refused)
        return dsv4_runtime.pool_bytes(cfg, rt, num_pages, layers, rank, cp_size)
    if cfg.dsa is not None:
        return dsa_runtime.pool_bytes(cfg, rt, num_pages, rank, cp_size, layers)
    held = pool_layers(len(layers), rank, cp_size) if rt.kv_cache == "layer-split" else len(layers)
    return held * num_pages * 2 * rt.page_size * cfg.num_kv_heads * cfg.head_dim * rt.torch_dtype.itemsize
