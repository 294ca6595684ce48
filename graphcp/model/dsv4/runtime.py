"""What a PrefillEngine runs a DeepSeek V4 model with: its paged cache (window, source
rows, compressed entries: graphcp/kv/dsv4.py, replicated on every CP rank) and the
attention break's backend (the torch reference). The options V4 does not combine with
are refused with the config (graphcp/combinations.py)."""

from __future__ import annotations

import torch

from graphcp.attention.sparse.dsv4 import DsV4AttentionSpec, TorchDsV4Attention
from graphcp.config import RuntimeConfig
from graphcp.kv.dsv4 import DsV4KVCache, entries_per_page
from graphcp.model.config import ModelConfig
from graphcp.model.dsv4.rope import COMPRESS, V4Rotary


def check_page_size(cfg: ModelConfig, page_size: int, where: str = "RuntimeConfig.page_size") -> None:
    """ConfigError naming ``where`` when a compress rate and the page size do not divide."""
    for rate in (cfg.dsv4.compress_csa, cfg.dsv4.compress_hca):
        entries_per_page(page_size, rate, where)


def pool_bytes(cfg: ModelConfig, rt: RuntimeConfig, num_pages: int, layers: range | None = None) -> int:
    """Bytes of a rank's pools for ``layers`` (a pipeline stage's; None: the model's)."""
    return num_pages * DsV4KVCache.bytes_per_page(cfg.dsv4.cache, rt.page_size, rt.torch_dtype.itemsize, layers)


def make_cache_and_attention(cfg: ModelConfig, rt: RuntimeConfig, num_pages: int, max_pages_per_seq: int,
                             device: torch.device, rotary: V4Rotary,
                             layers: range | None = None) -> tuple[DsV4KVCache, TorchDsV4Attention]:
    """The cache of ``layers`` (a pipeline stage's; None: the model's) and the backend."""
    d = cfg.dsv4
    kv = DsV4KVCache(d.cache, num_pages, rt.page_size, rt.torch_dtype, device, max_pages_per_seq, layers)
    spec = DsV4AttentionSpec(d.cache, cfg.num_heads, d.sliding_window, d.index_n_heads, d.index_topk,
                             cfg.rms_norm_eps)
    return kv, TorchDsV4Attention(spec, *rotary.table(COMPRESS), layers)
