"""What a PrefillEngine runs a DSA model with: the sparse MLA attention (its cache, the
latent + indexer keys, replicated or split by layer, comes from graphcp.kv.factory), and
the pipeline stages these models refuse."""

from __future__ import annotations

import torch

from graphcp.config import RuntimeConfig
from graphcp.errors import ConfigError
from graphcp.model.config import ModelConfig
from graphcp.model.dsa.sparse import SparseMlaBackend, SparseMlaSpec, TorchSparseMla
from graphcp.model.dsa.sparse_decode import PagedSparseMlaDecode


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


def carried_selections(indexer_layers: tuple[bool, ...]) -> frozenset[int]:
    """The indexer layers whose selection a later 'shared' layer reuses (GLM-5's
    ``indexer_types``): the last indexer layer before each shared one."""
    out, last = set(), None
    for i, full in enumerate(indexer_layers):
        if full:
            last = i
        elif last is not None:
            out.add(last)
    return frozenset(out)


def make_attention(cfg: ModelConfig, rt: RuntimeConfig, device: torch.device) -> SparseMlaBackend:
    """The sparse MLA backend (the torch reference, or the Triton kernel); a decode graph
    captures its static form (graphcp/model/dsa/sparse_decode.py)."""
    backend = _make_backend(cfg, rt, device)
    backend.decode_form = PagedSparseMlaDecode
    return backend


def _make_backend(cfg: ModelConfig, rt: RuntimeConfig, device: torch.device) -> SparseMlaBackend:
    d = cfg.dsa
    spec = SparseMlaSpec(cfg.num_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank,
                         d.index_n_heads, d.index_head_dim, d.index_topk, d.softmax_scale, d.num_indexer_layers,
                         carried_selections(d.indexer_layers))
    if rt.attention != "triton":
        return TorchSparseMla(spec)
    from graphcp.attention.backends.triton import cpu_problem

    if (problem := cpu_problem(device)) is not None:
        raise ConfigError(f"RuntimeConfig.attention='triton': {problem}")
    from graphcp.model.dsa.sparse_triton import TritonSparseMla  # imports triton: only when chosen

    try:
        return TritonSparseMla(spec)
    except ImportError as e:
        raise ConfigError(f"RuntimeConfig.attention='triton': {e}") from e
