"""The GLM-5-Next family (``Glm5NextForConditionalGeneration``'s text model; the vision
tower is not read): KDA layers scanned across the CP ranks and MLA layers with no RoPE
and the pooled lightning indexer, on hyper-connection streams, with DeepSeek's MoE. Its
cache is the KDA hybrids' (graphcp.model.kimi_linear.cache: each indexed layer's latent
and, where it runs the indexer, the indexer's key and pooling gate; each KDA layer's
states), its exchange theirs; its sparse attention the DSA family's torch reference with
the pooled selection (``indexer.py``); its export ``graphcp-glm5next/1`` (``export.py``)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch

from graphcp.errors import ConfigError
from graphcp.model.config import ModelConfig
from graphcp.model.family import AttentionParts, ModelFamily, register_family
from graphcp.model.glm5_next import checkpoint
from graphcp.model.glm5_next.config import Glm5Config, read_glm5next
from graphcp.model.glm5_next.export import GLM5_FORMAT, Glm5Meta, to_glm5_cache
from graphcp.model.glm5_next.indexer import PooledDecode, PooledSparseMla
from graphcp.model.glm5_next.model import Glm5Model
from graphcp.model.glm5_next.presets import PRESETS
from graphcp.model.kimi_linear.cache import KdaGeometry
from graphcp.model.kimi_linear.checkpoint import spelling
from graphcp.model.kimi_linear.export import KdaExport, kda_meta
from graphcp.model.kimi_linear.family import kda_geometry, latent_spec
from graphcp.pd.formats import register_format

register_format(GLM5_FORMAT, Glm5Meta, KdaExport, to_glm5_cache)


def index_layers(g: Glm5Config) -> tuple[int, ...]:
    return tuple(i for i, full in enumerate(g.indexer.layers) if full)


def check_stages(g: Glm5Config, stages: list[range], flags: bool = False) -> None:
    """A pipeline stage may not start at a 'shared' indexed layer (it reuses the selection
    of the layer before it, on the stage before)."""
    for s, layers in enumerate(stages):
        if s > 0 and g.indexer.shared[layers.start]:
            split = "--pp-layers" if flags else "ParallelConfig.pp_layers"
            raise ConfigError(f"pipeline stage {s} starts at layer {layers.start}, a 'shared' indexed layer "
                              f"(indexer_types) that reuses the top-k of layer {layers.start - 1} on stage {s - 1}; "
                              f"move the boundary with {split}")


class Glm5Family(ModelFamily):
    name = "GLM-5-Next"
    architectures = {"Glm5NextForConditionalGeneration": "glm5_next"}
    presets = PRESETS
    model_class = Glm5Model
    #: every rank holds every head (attention TP 1: MLA's latent is one head)
    export_splits_heads = False

    def read_config(self, d: dict[str, Any], model_type: str, source: str) -> ModelConfig:
        return read_glm5next(d, model_type, source)

    def kind(self, cfg: ModelConfig) -> str:
        return "kda"

    def check_run(self, cfg, runtime, parallel, flags: bool = False) -> None:
        if runtime.aux_hidden_layers:
            what = "--aux-hidden-layers" if flags else "RuntimeConfig.aux_hidden_layers"
            raise ConfigError(f"{what} with a GLM-5-Next model: a layer's output is hc_mult residual streams, not one "
                              f"hidden row to copy out (as DeepSeek V4's); leave {what} unset")
        check_stages(cfg.hybrid, parallel.stage_layers(cfg.num_layers), flags)

    def attention(self, name: str, device) -> str:
        return "torch" if name == "auto" else name  # the latent attention's reference

    def tensor_table(self, cfg, rank, tp, moe, shard):
        return checkpoint.glm5_tensors(cfg, rank, tp, moe)

    def tensor_table_for(self, cfg, rank, tp, moe, shard, names):
        return checkpoint.glm5_tensors(cfg, rank, tp, moe, spelling(names))

    def skips_tensor(self, cfg, name: str) -> bool:
        return name.startswith(checkpoint.VISION)

    def random_weights(self, config: dict, seed: int):
        return checkpoint.random_weights(ModelConfig.from_hf_dict(config, "preset"), seed)

    def cache_geometry(self, cfg, runtime, kv_layout: str = "NHD") -> KdaGeometry:
        g: Glm5Config = cfg.hybrid
        return kda_geometry(cfg, g, runtime, 2 * g.indexer.head_dim, g.indexer.layers)

    def make_attention(self, parts: AttentionParts, workspace: torch.Tensor | None = None) -> PooledSparseMla:
        g: Glm5Config = parts.cfg.hybrid
        ix = g.indexer
        spec = latent_spec(parts.cfg, g.latent, ix.n_heads, ix.head_dim, ix.width, sum(ix.layers))
        spec = replace(spec, carries=ix.carried)
        indexers = {layer.layer: layer.self_attn.indexer for layer in parts.model.layers
                    if layer.full and layer.self_attn.indexer is not None}
        backend = PooledSparseMla(spec, ix, indexers)
        backend.decode_form = partial(PooledDecode, ix=ix, indexers=indexers)  # what a decode graph captures
        return backend

    def export_meta(self, cfg, num_tokens: int, runtime, fingerprint: str, draft_layers: int) -> Glm5Meta:
        g: Glm5Config = cfg.hybrid
        return kda_meta(Glm5Meta, cfg, g.kda, g.latent, g.indexer.head_dim, index_layers(g), num_tokens, runtime,
                        fingerprint)


GLM5 = register_family(Glm5Family())
