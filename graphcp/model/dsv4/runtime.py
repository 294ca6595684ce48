"""What a PrefillEngine runs a DeepSeek V4 model with: its paged cache (window, source
rows, compressed entries: graphcp/kv/dsv4.py, replicated on every CP rank or split by
layer) and the
attention break's backend (the torch reference). The options V4 does not combine with
are refused with the config (graphcp/combinations.py)."""

from __future__ import annotations

import torch

from graphcp.attention.sparse.dsv4 import DsV4AttentionSpec, TorchDsV4Attention
from graphcp.config import RuntimeConfig
from graphcp.kv.dsv4 import DsV4KVCache, LayerSplitDsV4KVCache, entries_per_page
from graphcp.kv.spans import owned_layers
from graphcp.model.config import ModelConfig
from graphcp.model.dsv4.rope import COMPRESS, V4Rotary


def check_page_size(cfg: ModelConfig, page_size: int, where: str = "RuntimeConfig.page_size") -> None:
    """ConfigError naming ``where`` when a compress rate and the page size do not divide."""
    for rate in (cfg.dsv4.compress_csa, cfg.dsv4.compress_hca):
        entries_per_page(page_size, rate, where)


def pool_bytes(cfg: ModelConfig, rt: RuntimeConfig, num_pages: int, layers: range | None = None, rank: int = 0,
               cp_size: int = 1) -> int:
    """Bytes of rank ``rank``'s pools for ``layers`` (a pipeline stage's; None: the
    model's); under ``layer-split`` its own of them and one scratch layer a pool."""
    layers = layers if layers is not None else range(cfg.num_layers)
    served = None
    if rt.kv_cache == "layer-split":
        own = owned_layers(rank, len(layers), cp_size)
        served, layers = layers, range(layers.start + own.start, layers.start + own.stop)
    return num_pages * DsV4KVCache.bytes_per_page(cfg.dsv4.cache, rt.page_size, rt.torch_dtype.itemsize, layers,
                                                  served)


def make_cache_and_attention(cfg: ModelConfig, rt: RuntimeConfig, num_pages: int, max_pages_per_seq: int,
                             device: torch.device, rotary: V4Rotary, layers: range | None = None, rank: int = 0,
                             cp_size: int = 1) -> tuple[DsV4KVCache, TorchDsV4Attention]:
    """The cache of ``layers`` (a pipeline stage's; None: the model's; ``layer-split``:
    rank ``rank``'s of them over ``cp_size`` ranks) and the backend."""
    d = cfg.dsv4
    if rt.kv_cache == "layer-split":
        kv = LayerSplitDsV4KVCache(d.cache, num_pages, rt.page_size, rt.torch_dtype, device, max_pages_per_seq, rank,
                                   cp_size, layers)
    else:
        kv = DsV4KVCache(d.cache, num_pages, rt.page_size, rt.torch_dtype, device, max_pages_per_seq, layers)
    spec = DsV4AttentionSpec(d.cache, cfg.num_heads, d.sliding_window, d.index_n_heads, d.index_topk,
                             cfg.rms_norm_eps)
    return kv, TorchDsV4Attention(spec, *rotary.table(COMPRESS), layers)
