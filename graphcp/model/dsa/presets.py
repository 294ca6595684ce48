"""The DSA family's built-in preset (config.json written with seeded random weights on
first use, graphcp.model.presets)."""

from __future__ import annotations

PRESETS: dict[str, dict] = {}
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
