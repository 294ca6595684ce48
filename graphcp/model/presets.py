"""Built-in model presets: small configs with seeded random weights, written once
in Hugging Face format (config.json + model.safetensors) to a cache folder and
then loaded like any checkpoint (transformers loads the same folder).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from graphcp.errors import ConfigError
from graphcp.model.config import ModelConfig
from graphcp.model.dsa import checkpoint as dsa_checkpoint
from graphcp.model.dsa_config import DSA_FAMILIES
from graphcp.model.dsv4 import checkpoint as dsv4_checkpoint
from graphcp.model.dsv4_config import FAMILY as DSV4_FAMILY
from graphcp.model.moe_config import MOE_NAMES, moe_from_hf

#: a small Qwen3-style model: explicit head_dim, q/k norm, GQA, tied embeddings
PRESETS: dict[str, dict] = {
    "default": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 8192,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # a larger config for GPU timing (not written unless asked for)
    "qwen3-1b-like": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 32768,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}
#: a small DeepSeek V3.2 (DSA: MLA + the lightning indexer, index_topk 256; layer 0
#: dense, the rest DeepSeek MoE), for `graphcp prefill|run --model default-dsa`; 16 indexer heads
#: (V3.2 has 64): with few, keys every head scores negative tie at exactly 0
PRESETS["default-dsa"] = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 256,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 128,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
}
#: the default model's mixture-of-experts twin (Qwen3-MoE style): 16 experts, top-4,
#: layer 0 dense (mlp_only_layers), for `graphcp run --model default-moe [--moe ep|tp]`
PRESETS["default-moe"] = {
    **PRESETS["default"],
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 128,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
}
#: a small DeepSeek V4 (docs/dsv4.md): layer kinds sliding, CSA (m = 4, the indexer's
#: top-64 of 16 heads), HCA (m' = 128), CSA; a window of 128; mHC of 4 streams; hash MoE in
#: layer 0, score-routed (sqrt-softplus) in the rest, 16 experts top-4 and a shared expert;
#: YaRN on the compressed branches; for `graphcp run|prefill --model default-v4 [--moe ep|tp]`
PRESETS["default-v4"] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 8192,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "q_lora_rank": 128,
    "o_groups": 4,
    "o_lora_rank": 64,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "sliding_window": 128,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 64,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
                     "rope_theta": 160000.0, "partial_rotary_factor": 0.25, "attention_factor": 1.0},
    },
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
}
SEED = 1234


def cache_root() -> Path:
    return Path(os.environ.get("GRAPHCP_CACHE", Path.home() / ".cache" / "graphcp"))


def is_preset(name: str) -> bool:
    return name in PRESETS


def random_weights(config: dict, seed: int = SEED) -> dict[str, torch.Tensor]:
    """HF-named tensors for a Llama-family config (Qwen3-MoE and Mixtral too: router and
    per-expert tensors in the Hub layout), seeded (std 0.02; norms near 1); DSA configs:
    graphcp/model/dsa/checkpoint.py's writer."""
    if config["model_type"] in DSA_FAMILIES:
        return dsa_checkpoint.random_weights(ModelConfig.from_hf_dict(config), seed)
    if config["model_type"] == DSV4_FAMILY:
        return dsv4_checkpoint.random_weights(ModelConfig.from_hf_dict(config), seed)
    g = torch.Generator().manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or h // heads
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.get("torch_dtype", "float32")]
    qwen3 = config["model_type"] in ("qwen3", "qwen3_moe")
    moe = moe_from_hf(config, config["model_type"], config["num_hidden_layers"], "preset")

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    w = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": norm(h)}
    if not config.get("tie_word_embeddings", False):
        w["lm_head.weight"] = rnd(v, h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = rnd(heads * d, h)
        w[p + "self_attn.k_proj.weight"] = rnd(kv * d, h)
        w[p + "self_attn.v_proj.weight"] = rnd(kv * d, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, heads * d)
        if qwen3:
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
        if moe is not None and moe.is_sparse(layer):
            module, (gate, up, down) = MOE_NAMES[config["model_type"]]
            w[p + f"{module}.gate.weight"] = rnd(moe.num_experts, h)
            for e in range(moe.num_experts):
                w[p + f"{module}.experts.{e}.{gate}.weight"] = rnd(moe.intermediate_size, h)
                w[p + f"{module}.experts.{e}.{up}.weight"] = rnd(moe.intermediate_size, h)
                w[p + f"{module}.experts.{e}.{down}.weight"] = rnd(h, moe.intermediate_size)
            continue
        w[p + "mlp.gate_proj.weight"] = rnd(i, h)
        w[p + "mlp.up_proj.weight"] = rnd(i, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, i)
    return w


def ensure_preset(name: str, root: Path | None = None) -> Path:
    """The preset's checkpoint folder, written on first use (atomically)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    return ensure_random_model(name, PRESETS[name], root)


def ensure_random_model(name: str, config: dict, root: Path | None = None) -> Path:
    """Checkpoint folder ``<root>/models/<name>`` of ``config`` with seeded random
    weights, written on first use (atomically); a preset, or a variant of one."""
    folder = (root or cache_root()) / "models" / name
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(random_weights(config), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "config.json").exists():  # not another process winning the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def resolve_model(name_or_dir: str | os.PathLike) -> Path:
    """A preset name or a checkpoint folder -> the folder."""
    s = str(name_or_dir)
    if is_preset(s) and not Path(s).exists():
        return ensure_preset(s)
    p = Path(s)
    if not p.is_dir():
        raise ConfigError(f"model {s!r} is neither a preset ({sorted(PRESETS)}) nor a checkpoint folder")
    return p
