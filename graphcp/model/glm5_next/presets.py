"""GLM-5-Next's built-in preset (config.json written with seeded random weights on first
use, graphcp.model.presets)."""

from __future__ import annotations

#: a small GLM-5-Next text model as save_pretrained writes Glm5NextForConditionalGeneration's
#: config (the text model under text_config, no vision tower: its tensors are not read):
#: KDA, KDA, indexed ('full'), indexed ('shared': the top-k of the layer before), KDA, indexed
#: ('full'); 4 KDA heads of 32 (the bounded gate), MLA with no RoPE, the indexer's 8 heads
#: scoring pools of 8 tokens (64 tokens a row: 8 pools and the row's own); 2 streams;
#: layer 0 dense, then DeepSeek's MoE (16 experts, top 4 of 2 of 4 groups, a shared
#: expert); special tokens none (the defaults exceed the vocabulary), for
#: `graphcp run|prefill --model default-glm5next`
PRESETS: dict[str, dict] = {
    "default-glm5next": {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "glm5_next_text",
            "vocab_size": 8192,
            "hidden_size": 128,
            "intermediate_size": 384,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 64,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 0,
            "v_head_dim": 32,
            "layer_types": ["linear_attention", "linear_attention", "indexed_attention", "indexed_attention",
                            "linear_attention", "indexed_attention"],
            "indexer_types": ["full", "full", "full", "shared", "full", "full"],
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse", "sparse"],
            "linear_head_dim": 32,
            "linear_num_heads": 4,
            "linear_conv_kernel_dim": 4,
            "linear_lower_bound": -5.0,
            "index_n_heads": 8,
            "index_head_dim": 32,
            "index_topk": 64,
            "index_kpool": 8,
            "index_kpool_always_select_tail": True,
            "hc_mult": 2,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "swiglu_limit": 10.0,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "attention_bias": False,
            "pad_token_id": None,
            "bos_token_id": None,
            "eos_token_id": None,
        },
    },
}
