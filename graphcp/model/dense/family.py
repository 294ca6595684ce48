"""The dense decoder family: Llama (incl. llama3 RoPE scaling), Mistral, Qwen2 (q/k/v
bias), Qwen3 (q/k RMSNorm, explicit head_dim), and the mixture-of-experts Qwen3-MoE and
Mixtral (graphcp/model/moe/). Its cache holds K and V of this rank's KV heads, in any
cache mode; its export is ``graphcp-kv/1`` (graphcp.pd.export)."""

from __future__ import annotations

from typing import Any

import torch

from graphcp.attention.base import AttentionBackend, AttentionSpec
from graphcp.attention.registry import make_attention, preferred_kv_layout
from graphcp.attention.registry import resolve as resolve_attention
from graphcp.errors import ConfigError
from graphcp.kv.spec import KVHeads
from graphcp.model.config import ConfigReader, ModelConfig, decoder_config, read_head
from graphcp.model.dense import checkpoint
from graphcp.model.dense.presets import PRESETS
from graphcp.model.family import AttentionParts, ModelFamily, register_family
from graphcp.model.llama import DecoderModel
from graphcp.model.moe_config import moe_from_hf
from graphcp.model.rope import rope_from_hf
from graphcp.pd.export import KVMeta


class DenseFamily(ModelFamily):
    name = "dense decoder"
    architectures = {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "MixtralForCausalLM": "mixtral",
    }
    presets = PRESETS
    model_class = DecoderModel

    def read_config(self, d: dict[str, Any], model_type: str, source: str) -> ModelConfig:
        r = ConfigReader(d, source)
        head = read_head(r, window_by_default=model_type in ("mistral", "mixtral"))
        rope = rope_from_hf(d, source, head.max_positions)
        qwen2 = model_type == "qwen2"  # q/k/v bias, none on o_proj
        return decoder_config(
            r, model_type, head, rope, attention_bias=qwen2 or head.attention_bias,
            o_bias=not qwen2 and head.attention_bias, qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe=lambda r: moe_from_hf(r.d, model_type, head.num_layers, r.source))

    def kind(self, cfg: ModelConfig) -> str:
        return "moe" if cfg.moe is not None else "dense"

    def attention(self, name: str, device) -> str:
        return resolve_attention(name, device)

    def tensor_table(self, cfg, rank, tp, moe, shard):
        return checkpoint.dense_tensors(cfg, rank, tp, moe, shard)

    def unexpected_hint(self, cfg, name: str) -> str:
        return checkpoint.unexpected_hint(cfg, name)

    def random_weights(self, config: dict, seed: int):
        return checkpoint.random_weights(config, seed)

    weights_recipe = 2  # 2: matrices GAIN / sqrt(fan-in), embeddings std 1 (1: std 0.02, greedy text repeated)

    def cache_geometry(self, cfg, runtime, kv_layout: str = "NHD") -> KVHeads:
        return KVHeads(cfg.num_kv_heads, cfg.head_dim, kv_layout)

    def kv_layout(self, runtime, device) -> str:
        """The page layout the chosen backend reads (trtllm: HND)."""
        return preferred_kv_layout(runtime.attention, device)

    def make_attention(self, parts: AttentionParts, workspace: torch.Tensor | None = None) -> AttentionBackend:
        rt, acfg = parts.runtime, parts.attn_cfg
        spec = AttentionSpec(acfg.num_heads, acfg.num_kv_heads, acfg.head_dim, rt.page_size, acfg.head_dim ** -0.5,
                             parts.kv.layout)
        try:
            return make_attention(rt.attention, spec, parts.device, parts.limits, workspace=workspace)
        except (ValueError, ImportError) as e:  # a backend refusing this model or device, or not installed
            raise ConfigError(f"RuntimeConfig.attention={rt.attention!r}: {e}") from e

    def export_meta(self, cfg, num_tokens: int, runtime, fingerprint: str, draft_layers: int) -> KVMeta:
        return KVMeta(num_tokens, cfg.num_layers + draft_layers, cfg.num_kv_heads, cfg.head_dim, runtime.dtype,
                      runtime.page_size, fingerprint, draft_layers=draft_layers)


DENSE = register_family(DenseFamily())
