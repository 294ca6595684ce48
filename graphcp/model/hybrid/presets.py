"""The hybrid family's built-in preset (config.json written with seeded random weights on
first use, graphcp.model.presets)."""

from __future__ import annotations

#: a small Qwen3.5-style dense hybrid: three Gated DeltaNet layers then a full-attention
#: layer (output gate, q/k norm, RoPE on a quarter of each head), twice; 4 key heads serving
#: 8 value heads, a convolution of 4; for `graphcp run|prefill --model default-hybrid`
PRESETS: dict[str, dict] = {
    "default-hybrid": {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 8192,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}
