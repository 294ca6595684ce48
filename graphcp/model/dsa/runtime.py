"""What a PrefillEngine runs a DSA model with: the latent + indexer-key cache (replicated,
or split by layer over the CP ranks) and the sparse MLA attention, and the pipeline
stages these models refuse."""

from __future__ import annotations

import torch

from graphcp.attention.sparse.mla import SparseMlaBackend, SparseMlaSpec, TorchSparseMla
from graphcp.config import RuntimeConfig
from graphcp.errors import ConfigError
from graphcp.kv.mla import MlaKVCache
from graphcp.kv.mla_layer_split import LayerSplitMlaKVCache, mla_pool_layers
from graphcp.model.config import ModelConfig


def check_stages(cfg: ModelConfig, stages: list[range], flags: bool = False) -> None:
    """Refuse pipeline stages of a DSA model that start at a GLM-5 'shared' indexer layer
    (it reuses the top-k of the layer before it, on the stage before); ``flags``: name the
    command-line flags. The options DSA models do not combine with are refused with the
    config (graphcp/combinations.py)."""
    for s, layers in enumerate(stages):
        if s > 0 and not cfg.dsa.indexer_layers[layers.start]:
            full = [i for i, f in enumerate(cfg.dsa.indexer_layers) if f]
            pp, split = ("--pp", "--pp-layers") if flags else ("ParallelConfig.pp_size=", "ParallelConfig.pp_layers")
            raise ConfigError(
                f"{pp}{' ' if flags else ''}{len(stages)}: stage {s} starts at layer {layers.start}, a 'shared' layer "
                f"(indexer_types) that reuses the top-k of the last 'full' layer before it, on stage {s - 1}; "
                f"start every stage at a 'full' layer (one of {full}) with {split}")


def pool_bytes(cfg: ModelConfig, rt: RuntimeConfig, num_pages: int, rank: int, cp_size: int,
               layers: range | None = None) -> int:
    """Bytes of one rank's pools for ``layers`` (a pipeline stage's; None: the model's);
    a layer split: the layers it holds, scratch included."""
    d = cfg.dsa
    indexer = d.indexer_layers[layers.start:layers.stop] if layers is not None else d.indexer_layers
    held, index_held = len(indexer), sum(indexer)
    if rt.kv_cache == "layer-split":
        held, index_held = mla_pool_layers(indexer, rank, cp_size)
    return num_pages * MlaKVCache.bytes_per_page(held, rt.page_size, d.latent_dim, d.index_head_dim, index_held,
                                                 rt.torch_dtype.itemsize)


def make_cache_and_attention(cfg: ModelConfig, rt: RuntimeConfig, num_pages: int, max_pages_per_seq: int,
                             device: torch.device, rank: int = 0, cp_size: int = 1,
                             stages: list[range] | None = None,
                             stage: int = 0) -> tuple[MlaKVCache, SparseMlaBackend]:
    """The cache of pipeline stage ``stage``'s layers (of ``stages``; None: one stage) and
    the sparse MLA backend."""
    check_stages(cfg, stages or [])
    d = cfg.dsa
    layers = stages[stage] if stages else range(cfg.num_layers)
    args = (len(layers), num_pages, rt.page_size, d.kv_lora_rank, d.qk_rope_head_dim, d.index_head_dim,
            d.indexer_layers[layers.start:layers.stop], rt.torch_dtype, device, max_pages_per_seq)
    if rt.kv_cache == "layer-split":
        kv = LayerSplitMlaKVCache(*args, rank=rank, cp_size=cp_size, first_layer=layers.start)
    else:
        kv = MlaKVCache(*args, first_layer=layers.start)
    spec = SparseMlaSpec(cfg.num_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank,
                         d.index_n_heads, d.index_head_dim, d.index_topk, d.softmax_scale, d.num_indexer_layers)
    if rt.attention != "triton":
        return kv, TorchSparseMla(spec)
    from graphcp.attention.backends.triton import cpu_problem

    if (problem := cpu_problem(device)) is not None:
        raise ConfigError(f"RuntimeConfig.attention='triton': {problem}")
    from graphcp.attention.sparse.triton import TritonSparseMla  # imports triton: only when chosen

    try:
        return kv, TritonSparseMla(spec)
    except ImportError as e:
        raise ConfigError(f"RuntimeConfig.attention='triton': {e}") from e
