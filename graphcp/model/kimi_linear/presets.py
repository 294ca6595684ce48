"""Kimi Linear's built-in preset (config.json written with seeded random weights on first
use, graphcp.model.presets)."""

from __future__ import annotations

#: a small Kimi Linear in Kimi K3's layout: three KDA layers then an MLA layer (no RoPE;
#: q_proj, no query latent), twice; 8 KDA heads of 32, a convolution of 4; layer 0 dense,
#: then DeepSeek's MoE (16 experts, top 4 of 2 of 4 groups, a shared expert); written as
#: save_pretrained writes it (linear_attn_config's 1-indexed layers, Kimi's key spellings),
#: for `graphcp run|prefill --model default-kimi`
PRESETS: dict[str, dict] = {
    "default-kimi": {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 8192,
        "hidden_size": 256,
        "intermediate_size": 768,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": None,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "linear_attn_config": {"head_dim": 32, "num_heads": 8, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]},
        "first_k_dense_replace": 1,
        "num_experts": 16,
        "num_experts_per_token": 4,
        "num_expert_group": 4,
        "topk_group": 2,
        "num_shared_experts": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "hidden_act": "silu",
        "model_max_length": 32768,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,  # (transformers' default id is past this vocabulary)
    },
}
