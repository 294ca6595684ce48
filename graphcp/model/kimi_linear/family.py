"""The Kimi Linear family (``KimiLinearForCausalLM``, docs/hybrid.md): Kimi Delta Attention
layers scanned across the CP ranks, MLA layers with no positional encoding, DeepSeek's
MoE. Its cache's storage holds the MLA layers' latent rows and each live request's KDA
states (``cache.py``, its exchange ``exchange.py``: the hybrid family's scan with KDA's
kernels); its export is ``graphcp-kda/1`` (``export.py``, its transformers cache
``hf_cache.py``). This module registers the storage and the format. GLM-5-Next's text
model (graphcp.model.glm5_next) reuses the KDA layer, the MLA, the cache and the export."""

from __future__ import annotations

from typing import Any

import torch

from graphcp.kv.factory import register_storage
from graphcp.model.config import ModelConfig
from graphcp.model.dsa.sparse import SparseMlaSpec, TorchSparseMla
from graphcp.model.family import AttentionParts, ModelFamily, register_family
from graphcp.model.kimi_linear import checkpoint
from graphcp.model.kimi_linear.cache import KdaGeometry, KdaStorage, LatentGeometry, linear_dims
from graphcp.model.kimi_linear.config import KimiConfig, LatentConfig, read_kimi
from graphcp.model.kimi_linear.exchange import KdaAllGather
from graphcp.model.kimi_linear.export import KDA_FORMAT, KdaExport, KdaMeta, kda_meta
from graphcp.model.kimi_linear.hf_cache import to_kda_cache
from graphcp.model.kimi_linear.latent_decode import DenseLatentDecode
from graphcp.model.kimi_linear.model import KimiModel
from graphcp.model.kimi_linear.presets import PRESETS
from graphcp.pd.formats import register_format

register_storage(KdaGeometry, KdaStorage)
register_format(KDA_FORMAT, KdaMeta, KdaExport, to_kda_cache)
#: the exchange the storage names (registered when its module is imported)
EXCHANGE = KdaAllGather.name

#: an index_topk no row reaches: every row attends to every earlier token (dense MLA)
DENSE = 1 << 62


def kda_geometry(cfg: ModelConfig, settings, runtime, index_dim: int = 0,
                 indexer_layers: tuple[bool, ...] | None = None) -> KdaGeometry:
    """A KDA hybrid's cache geometry (``settings``: its ``ModelConfig.hybrid``, with
    ``kda`` and ``latent``; ``index_dim`` / ``indexer_layers``: a pooled indexer's cache rows)."""
    k, m = settings.kda, settings.latent
    indexer = indexer_layers or (False,) * cfg.num_layers
    latent = LatentGeometry(m.kv_lora_rank, m.qk_rope_head_dim, index_dim, indexer, k.full_layers)
    slots = runtime.state_slots if runtime.state_slots is not None else runtime.max_requests
    return KdaGeometry(latent, k.layer_kinds, linear_dims(k.num_heads, k.head_dim, k.conv_kernel), slots)


def latent_spec(cfg: ModelConfig, m: LatentConfig, index_heads: int = 1, index_dim: int = 1, topk: int = DENSE,
                index_layers: int = 0) -> SparseMlaSpec:
    """What the DSA family's latent attention (graphcp.model.dsa.sparse) reads of an MLA
    with no RoPE: dense, or with a (pooled) indexer's selection of width ``topk``."""
    return SparseMlaSpec(cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank,
                         index_heads, index_dim, topk, m.softmax_scale, index_layers)


class KimiFamily(ModelFamily):
    name = "Kimi Linear"
    architectures = {"KimiLinearForCausalLM": "kimi_linear"}
    presets = PRESETS
    model_class = KimiModel
    #: every rank holds every head (attention TP 1: MLA's latent is one head)
    export_splits_heads = False

    def read_config(self, d: dict[str, Any], model_type: str, source: str) -> ModelConfig:
        return read_kimi(d, model_type, source)

    def kind(self, cfg: ModelConfig) -> str:
        return "kda"

    def attention(self, name: str, device) -> str:
        return "torch" if name == "auto" else name  # the latent attention's reference

    def tensor_table(self, cfg, rank, tp, moe, shard):
        return checkpoint.kimi_tensors(cfg, rank, tp, moe)

    def tensor_table_for(self, cfg, rank, tp, moe, shard, names):
        return checkpoint.kimi_tensors(cfg, rank, tp, moe, checkpoint.spelling(names))

    def random_weights(self, config: dict, seed: int):
        cfg = ModelConfig.from_hf_dict(config, "preset")
        return checkpoint.random_weights(checkpoint.kimi_tensors(cfg, 0, 1, "tp"), cfg.torch_dtype, seed)

    def cache_geometry(self, cfg, runtime, kv_layout: str = "NHD") -> KdaGeometry:
        return kda_geometry(cfg, cfg.hybrid, runtime)

    def make_attention(self, parts: AttentionParts, workspace: torch.Tensor | None = None) -> TorchSparseMla:
        """The DSA family's latent attention with no indexer; a decode graph captures its
        static dense form (latent_decode.py)."""
        backend = TorchSparseMla(latent_spec(parts.cfg, parts.cfg.hybrid.latent))
        backend.decode_form = DenseLatentDecode
        return backend

    def export_meta(self, cfg, num_tokens: int, runtime, fingerprint: str, draft_layers: int) -> KdaMeta:
        k: KimiConfig = cfg.hybrid
        return kda_meta(KdaMeta, cfg, k.kda, k.latent, 0, (), num_tokens, runtime, fingerprint)


KIMI = register_family(KimiFamily())
