"""The DeepSeek V4 family (docs/dsv4.md): window, CSA and HCA attention layers, mHC
residual streams, hash- and score-routed MoE. Its cache's storage holds each token's
window row, compressor source rows and pooled entries (replicated, or split by layer: ``cache.py``);
pooling, the indexer and attention run in the break (``sparse.py``); its export is
transformers' cache state, ``graphcp-dsv4/1`` (``export.py``, its transformers cache
``hf_cache.py``), read through the compressors' position biases (``source.py``). This
module registers the storage and the format."""

from __future__ import annotations

from typing import Any

import torch

from graphcp.errors import ConfigError
from graphcp.kv.factory import register_storage
from graphcp.kv.paged import PagedKVCache
from graphcp.model.config import ConfigReader, ModelConfig, decoder_config, read_head
from graphcp.model.dsv4 import checkpoint
from graphcp.model.dsv4.cache import DsV4CacheSpec, DsV4Storage
from graphcp.model.dsv4.config import dsv4_from_hf
from graphcp.model.dsv4.export import DSV4_FORMAT, DsV4Export, DsV4Meta, dsv4_meta
from graphcp.model.dsv4.hf_cache import to_dsv4_cache
from graphcp.model.dsv4.model import DsV4Model
from graphcp.model.dsv4.presets import PRESETS
from graphcp.model.dsv4.runtime import check_page_size, make_attention
from graphcp.model.dsv4.source import DsV4Source, export_source
from graphcp.model.dsv4.sparse import TorchDsV4Attention, work_report
from graphcp.model.family import AttentionParts, ModelFamily, attention_tp_names, register_family
from graphcp.model.tensor_table import is_skipped
from graphcp.pd.formats import register_format

register_storage(DsV4CacheSpec, DsV4Storage)
register_format(DSV4_FORMAT, DsV4Meta, DsV4Export, to_dsv4_cache)


class DsV4Family(ModelFamily):
    name = "DeepSeek V4"
    architectures = {"DeepseekV4ForCausalLM": "deepseek_v4"}
    presets = PRESETS
    model_class = DsV4Model
    #: one shared KV head, replicated over attention TP: every rank's cache holds it whole
    export_splits_heads = False

    def read_config(self, d: dict[str, Any], model_type: str, source: str) -> ModelConfig:
        r = ConfigReader(d, source)
        head = read_head(r)
        v4 = dsv4_from_hf(d, model_type, head.num_layers, head.max_positions, source)
        return decoder_config(r, model_type, head, v4.main_rope, intermediate_size=v4.moe_intermediate_size,
                              num_kv_heads=1, dsv4=v4)

    def kind(self, cfg: ModelConfig) -> str:
        return "dsv4"

    def attention(self, name: str, device) -> str:
        return "torch" if name == "auto" else name  # the torch reference in the break

    def experts(self, cfg: ModelConfig) -> list:
        return [cfg.dsv4.moe]  # every V4 layer is a MoE layer

    def has_dense_mlp(self, cfg: ModelConfig) -> bool:
        return False

    def check_heads(self, cfg: ModelConfig, size: int, source: str, flags: bool = False) -> None:
        super().check_heads(cfg, size, source, flags)
        if cfg.dsv4.o_groups % size:  # a rank projects its heads' whole groups
            split, change = attention_tp_names(flags)
            raise ConfigError(f"{source}: o_groups={cfg.dsv4.o_groups} does not divide by attention TP {size} "
                              f"({split}): {change}")

    def check_run(self, cfg, runtime, parallel, flags: bool = False) -> None:
        # its entries are paged with the tokens they pool
        check_page_size(cfg, runtime.page_size, "--page-size" if flags else "RuntimeConfig.page_size")

    def tensor_table(self, cfg, rank, tp, moe, shard):
        return checkpoint.dsv4_tensors(cfg, rank, tp, moe, shard)

    def skips_tensor(self, cfg, name: str) -> bool:
        return is_skipped(name, cfg.num_layers)

    def random_weights(self, config: dict, seed: int):
        return checkpoint.random_weights(ModelConfig.from_hf_dict(config), seed)

    def cache_geometry(self, cfg, runtime, kv_layout: str = "NHD") -> DsV4CacheSpec:
        return cfg.dsv4.cache

    def make_attention(self, parts: AttentionParts, workspace: torch.Tensor | None = None) -> TorchDsV4Attention:
        return make_attention(parts.attn_cfg, parts.model.rotary, parts.model.stage.layers)

    def work_report(self, stats_per_rank: list[dict]) -> list[str]:
        line = work_report(stats_per_rank)
        return [] if line is None else [line]

    def export_meta(self, cfg, num_tokens: int, runtime, fingerprint: str, draft_layers: int) -> DsV4Meta:
        return dsv4_meta(cfg, num_tokens, runtime.dtype, runtime.page_size, fingerprint)

    def export_source(self, kv: PagedKVCache, model: DsV4Model) -> DsV4Source:
        """A V4 cache's state in transformers' terms (it adds the compressors' position biases)."""
        return export_source(kv, zip(model.stage.layers, model.layers), model.cfg.dsv4.sliding_window)


DSV4 = register_family(DsV4Family())
