"""The dense family's built-in presets (config.json written with seeded random weights
on first use, graphcp.model.presets)."""

from __future__ import annotations

#: a small Qwen3-style model: explicit head_dim, q/k norm, GQA; an untied LM head (a tied
#: one reads the embeddings back, and random ones large enough to carry the token through
#: the layers would make each token predict itself: checkpoint.random_weights)
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
        "tie_word_embeddings": False,
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
        "tie_word_embeddings": False,  # (as the default: greedy text varies)
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
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
