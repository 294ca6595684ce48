"""Attention tensor parallelism: which query and KV heads an attention-TP rank holds.

Query heads split evenly over the A ranks (``num_heads % A == 0``). KV heads split
evenly when ``num_kv_heads % A == 0``; with fewer KV heads than ranks (``A %
num_kv_heads == 0``) each rank holds the one KV head its query heads read, replicated
over ``A / num_kv_heads`` ranks, as vLLM and SGLang do. Anything else is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from graphcp.model.config import ModelConfig


@dataclass(frozen=True)
class HeadShard:
    size: int  # the attention-TP degree A
    rank: int  # this rank's attention-TP rank
    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int

    @property
    def split(self) -> bool:
        return self.size > 1


def head_shard(cfg: ModelConfig, size: int = 1, rank: int = 0) -> HeadShard:
    """Rank ``rank``'s heads at attention TP ``size`` (checked by ``ModelConfig.check_parallel``)."""
    nq = cfg.num_heads // size
    if cfg.num_kv_heads >= size:
        nk = cfg.num_kv_heads // size
        return HeadShard(size, rank, rank * nq, nq, rank * nk, nk)
    return HeadShard(size, rank, rank * nq, nq, rank * cfg.num_kv_heads // size, 1)


def local_config(cfg: ModelConfig, shard: HeadShard) -> ModelConfig:
    """``cfg`` with this rank's head counts (what caches, backends and rings size by)."""
    if not shard.split:
        return cfg
    return replace(cfg, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads)
