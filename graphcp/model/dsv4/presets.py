"""DeepSeek V4's built-in preset (config.json written with seeded random weights on
first use, graphcp.model.presets)."""

from __future__ import annotations

PRESETS: dict[str, dict] = {}
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
