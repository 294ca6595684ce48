"""The DSA family (DeepSeek V3.2, GLM-5): MLA with the lightning indexer and DeepSeek's
MoE. Its cache's storage holds each token's latent, rope key and indexer key (replicated, or
split by layer: ``cache.py``); its sparse attention is ``sparse.py`` (+
``sparse_triton.py``, ``topk.py``); its export is ``graphcp-mla/1`` (``export.py``, its
transformers cache ``hf_cache.py``). This module registers the storage and the format."""

from __future__ import annotations

from typing import Any

import torch

from graphcp.kv.factory import register_storage
from graphcp.model.config import ConfigReader, ModelConfig, decoder_config, read_head
from graphcp.model.dsa import checkpoint
from graphcp.model.dsa.cache import MlaGeometry, MlaStorage
from graphcp.model.dsa.config import dsa_from_hf
from graphcp.model.dsa.export import MLA_FORMAT, MlaExport, MlaMeta, mla_meta
from graphcp.model.dsa.hf_cache import to_mla_cache
from graphcp.model.dsa.model import DsaModel
from graphcp.model.dsa.presets import PRESETS
from graphcp.model.dsa.runtime import check_stages, make_attention
from graphcp.model.dsa.sparse import SparseMlaBackend, indexer_report
from graphcp.model.family import AttentionParts, ModelFamily, register_family
from graphcp.model.rope import rope_from_hf
from graphcp.model.tensor_table import is_skipped
from graphcp.pd.formats import register_format

register_storage(MlaGeometry, MlaStorage)
register_format(MLA_FORMAT, MlaMeta, MlaExport, to_mla_cache)


class DsaFamily(ModelFamily):
    name = "DSA"
    architectures = {"DeepseekV32ForCausalLM": "deepseek_v32", "GlmMoeDsaForCausalLM": "glm_moe_dsa"}
    presets = PRESETS
    model_class = DsaModel  # attention TP 1: its heads whole

    def read_config(self, d: dict[str, Any], model_type: str, source: str) -> ModelConfig:
        r = ConfigReader(d, source)
        head = read_head(r)
        rope = rope_from_hf(d, source, head.max_positions)
        dsa = dsa_from_hf(d, model_type, head.num_layers, rope, source)
        # RoPE's width is the rope part of a head (num_kv_heads = num_heads, checked by dsa_from_hf)
        return decoder_config(r, model_type, head, rope, head_dim=dsa.qk_rope_head_dim, dsa=dsa)

    def kind(self, cfg: ModelConfig) -> str:
        return "dsa"

    def attention(self, name: str, device) -> str:
        return "torch" if name == "auto" else name  # the sparse MLA reference; triton when asked

    def experts(self, cfg: ModelConfig) -> list:
        return [] if cfg.dsa.moe is None else [cfg.dsa.moe]

    def has_dense_mlp(self, cfg: ModelConfig) -> bool:
        return cfg.dsa.has_dense_layers(cfg.num_layers)

    def check_run(self, cfg, runtime, parallel, flags: bool = False) -> None:
        check_stages(cfg, parallel.stage_layers(cfg.num_layers), flags)

    def tensor_table(self, cfg, rank, tp, moe, shard):
        return checkpoint.dsa_tensors(cfg, rank, tp, moe)

    def skips_tensor(self, cfg, name: str) -> bool:
        return is_skipped(name, cfg.num_layers)

    def random_weights(self, config: dict, seed: int):
        return checkpoint.random_weights(ModelConfig.from_hf_dict(config), seed)

    def cache_geometry(self, cfg, runtime, kv_layout: str = "NHD") -> MlaGeometry:
        d = cfg.dsa
        return MlaGeometry(d.kv_lora_rank, d.qk_rope_head_dim, d.index_head_dim, d.indexer_layers)

    def make_attention(self, parts: AttentionParts, workspace: torch.Tensor | None = None) -> SparseMlaBackend:
        return make_attention(parts.cfg, parts.runtime, parts.device)

    def work_report(self, stats_per_rank: list[dict]) -> list[str]:
        line = indexer_report(stats_per_rank)
        return [] if line is None else [line]

    def export_meta(self, cfg, num_tokens: int, runtime, fingerprint: str, draft_layers: int) -> MlaMeta:
        return mla_meta(cfg, num_tokens, runtime.dtype, runtime.page_size, fingerprint)


DSA = register_family(DsaFamily())
