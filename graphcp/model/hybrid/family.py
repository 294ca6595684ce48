"""The linear-attention hybrid family (docs/hybrid.md): Qwen3.5 (``Qwen3_5ForCausalLM``),
Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``), Qwen3-Next (``Qwen3NextForCausalLM``) and the
text model of the multimodal Qwen3.5 checkpoints (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``; their vision tower skipped). Its cache's storage holds
the full-attention layers' K/V in any cache mode and each live request's linear-layer
states (``cache.py``, its exchange ``exchange.py``); the linear layers run the scan across the CP
ranks. Its export is ``graphcp-hybrid/1`` (``export.py``, its transformers cache
``hf_cache.py``). This module registers the storage and the format."""

from __future__ import annotations

from typing import Any

import torch

from graphcp.attention.base import AttentionBackend, AttentionSpec
from graphcp.attention.registry import make_attention, preferred_kv_layout
from graphcp.attention.registry import resolve as resolve_attention
from graphcp.errors import ConfigError
from graphcp.kv.factory import register_storage
from graphcp.kv.spec import KVHeads
from graphcp.model.config import ConfigReader, ModelConfig, decoder_config, read_head
from graphcp.model.family import AttentionParts, ModelFamily, attention_tp_names, register_family
from graphcp.model.hybrid import checkpoint
from graphcp.model.hybrid.cache import HybridGeometry, HybridStorage, LinearDims
from graphcp.model.hybrid.config import FULL, hybrid_from_hf, hybrid_moe, hybrid_rope, text_part
from graphcp.model.hybrid.export import HYBRID_FORMAT, HybridExport, HybridMeta
from graphcp.model.hybrid.hf_cache import to_hybrid_cache
from graphcp.model.hybrid.model import HybridModel
from graphcp.model.hybrid.presets import PRESETS
from graphcp.pd.formats import register_format

register_storage(HybridGeometry, HybridStorage)
register_format(HYBRID_FORMAT, HybridMeta, HybridExport, to_hybrid_cache)


class HybridFamily(ModelFamily):
    name = "linear-attention hybrid"
    architectures = {
        "Qwen3_5ForCausalLM": "qwen3_5_text",
        "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
        "Qwen3NextForCausalLM": "qwen3_next",
        "Qwen3_5ForConditionalGeneration": "qwen3_5",
        "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    }
    presets = PRESETS
    model_class = HybridModel

    def read_config(self, d: dict[str, Any], model_type: str, source: str) -> ModelConfig:
        text, where, prefix = text_part(d, model_type, source)
        r = ConfigReader(text, where)
        head = read_head(r)
        rope, rotary = hybrid_rope(text, where, head.max_positions, head.head_dim)
        hybrid = hybrid_from_hf(text, model_type, head.num_layers, head.num_heads, rotary, prefix, where)
        moe = hybrid_moe(text, model_type, head.num_layers, where)
        dense_size = None
        if moe is not None and len(moe.layers) == head.num_layers and "intermediate_size" not in text:
            dense_size = moe.intermediate_size  # (no dense layer: Qwen3.5-MoE has no intermediate_size)
        return decoder_config(r, model_type, head, rope, intermediate_size=dense_size, qk_norm=True, moe=moe,
                              hybrid=hybrid)

    def kind(self, cfg: ModelConfig) -> str:
        return "hybrid"

    def attention(self, name: str, device) -> str:
        return resolve_attention(name, device)

    def check_heads(self, cfg: ModelConfig, size: int, source: str, flags: bool = False) -> None:
        super().check_heads(cfg, size, source, flags)
        h = cfg.hybrid
        if size > 1 and h.num_k_heads % size:
            _, change = attention_tp_names(flags)
            raise ConfigError(f"{source}: linear_num_key_heads={h.num_k_heads} does not divide by attention TP "
                              f"{size} (a rank holds whole key heads and the value heads they serve): {change}")

    def tensor_table(self, cfg, rank, tp, moe, shard):
        return checkpoint.hybrid_tensors(cfg, rank, tp, moe, shard)

    def skips_tensor(self, cfg, name: str) -> bool:
        return checkpoint.is_skipped(name)

    def random_weights(self, config: dict, seed: int):
        cfg = ModelConfig.from_hf_dict(config, "preset")
        dtype = torch.bfloat16 if cfg.torch_dtype == "bfloat16" else torch.float32
        return checkpoint.random_weights(cfg, dtype, seed)

    def cache_geometry(self, cfg, runtime, kv_layout: str = "NHD") -> HybridGeometry:
        h = cfg.hybrid
        A = h.share(cfg.num_heads)  # cfg: this rank's heads
        dims = LinearDims(h.num_k_heads // A, h.num_v_heads // A, h.k_head_dim, h.v_head_dim, h.conv_kernel)
        slots = runtime.state_slots if runtime.state_slots is not None else runtime.max_requests
        # a draft's verify steps keep each row's states, in slots for the largest decode bucket's rows
        verify = max(runtime.decode_buckets) if runtime.draft is not None else 0
        return HybridGeometry(KVHeads(cfg.num_kv_heads, cfg.head_dim, kv_layout), h.layer_kinds, dims, slots, verify)

    def kv_layout(self, runtime, device) -> str:
        return preferred_kv_layout(runtime.attention, device)

    def make_attention(self, parts: AttentionParts, workspace: torch.Tensor | None = None) -> AttentionBackend:
        rt, acfg = parts.runtime, parts.attn_cfg
        spec = AttentionSpec(acfg.num_heads, acfg.num_kv_heads, acfg.head_dim, rt.page_size, acfg.head_dim ** -0.5,
                             parts.kv.layout)
        try:
            return make_attention(rt.attention, spec, parts.device, parts.limits, workspace=workspace)
        except (ValueError, ImportError) as e:
            raise ConfigError(f"RuntimeConfig.attention={rt.attention!r}: {e}") from e

    def export_meta(self, cfg, num_tokens: int, runtime, fingerprint: str, draft_layers: int) -> HybridMeta:
        h = cfg.hybrid
        return HybridMeta(num_tokens, cfg.num_layers + draft_layers, h.layer_kinds + (FULL,) * draft_layers,
                          cfg.num_kv_heads, cfg.head_dim, h.num_k_heads, h.num_v_heads, h.k_head_dim, h.v_head_dim,
                          h.conv_kernel, runtime.dtype, runtime.page_size, fingerprint, cfg.family,
                          draft_layers=draft_layers)


HYBRID = register_family(HybridFamily())
