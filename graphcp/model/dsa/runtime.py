"""What a PrefillEngine runs a DSA model with: the latent + indexer-key cache and the
sparse MLA attention, and the runtime options these models refuse."""

from __future__ import annotations

import torch

from graphcp.attention.sparse_mla import SparseMlaBackend, SparseMlaSpec, TorchSparseMla
from graphcp.config import ConfigError, ModelConfig, RuntimeConfig
from graphcp.mla_cache import MlaKVCache

#: RuntimeConfig.attention values a DSA model takes. auto: the torch reference, on any
#: device (the Triton kernel has not run on a GPU yet: it is chosen by name only)
DSA_ATTENTION = ("torch", "triton", "auto")


def check_runtime(cfg: ModelConfig, rt: RuntimeConfig) -> None:
    if rt.attention not in DSA_ATTENTION:
        raise ConfigError(f"RuntimeConfig.attention={rt.attention!r}: {cfg.family} models run MLA with the DSA indexer "
                          "on the torch sparse-MLA reference or the Triton sparse-MLA kernel only; use "
                          f"one of {', '.join(DSA_ATTENTION)}")
    if rt.graph == "full":
        raise ConfigError(f"RuntimeConfig.graph='full': {cfg.family} models run the indexer's top-k and sparse "
                          "attention in the attention break (they read the live batch's segments on the host); use "
                          "graph='breakable'")


def pool_bytes(cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype) -> int:
    d = cfg.dsa
    return num_pages * MlaKVCache.bytes_per_page(cfg.num_layers, page_size, d.latent_dim, d.index_head_dim,
                                                 d.num_indexer_layers, dtype.itemsize)


def make_cache_and_attention(cfg: ModelConfig, rt: RuntimeConfig, num_pages: int, max_pages_per_seq: int,
                             device: torch.device) -> tuple[MlaKVCache, SparseMlaBackend]:
    check_runtime(cfg, rt)
    d = cfg.dsa
    kv = MlaKVCache(cfg.num_layers, num_pages, rt.page_size, d.kv_lora_rank, d.qk_rope_head_dim, d.index_head_dim,
                    d.indexer_layers, rt.torch_dtype, device, max_pages_per_seq)
    spec = SparseMlaSpec(cfg.num_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank,
                         d.index_n_heads, d.index_head_dim, d.index_topk, d.softmax_scale, d.num_indexer_layers)
    if rt.attention != "triton":
        return kv, TorchSparseMla(spec)
    from graphcp.attention.sparse_mla_triton import TritonSparseMla  # imports triton: only when chosen

    try:
        return kv, TritonSparseMla(spec)
    except ImportError as e:
        raise ConfigError(f"RuntimeConfig.attention='triton': {e}") from e
