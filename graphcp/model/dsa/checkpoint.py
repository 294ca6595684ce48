"""Where each tensor of a DSA checkpoint (the Hugging Face Hub layout, as transformers
saves it) lands in :class:`~graphcp.model.dsa.model.DsaModel` on one rank.

Whole on every rank: embeddings, norms, the LM head, every attention and indexer
weight, the MoE routers. Tensor-parallel shards: the dense MLP's and the shared
experts' gate/up rows and down columns. Routed experts (one tensor per expert per
projection: ``mlp.experts.{e}.gate_proj.weight``): with ``--moe tp`` each expert's
shard on every rank; with ``--moe ep`` a rank reads its ``E / C`` experts whole and
only checks the shapes of the others'. The routers' weight and
``e_score_correction_bias`` are float32 in every checkpoint (transformers keeps them
so). Tensors of layers past ``num_hidden_layers`` (the multi-token-prediction layer
DeepSeek and GLM ship) are not used for prefill and are skipped.
"""

from __future__ import annotations

import torch

from graphcp.config import DTYPES
from graphcp.model.config import ModelConfig
from graphcp.model.tensor_table import TensorTarget, expert_targets, sharded_mlp
from graphcp.options import MoeLayout


def dsa_tensors(cfg: ModelConfig, rank: int, tp: int, moe: MoeLayout = "tp") -> dict[str, TensorTarget]:
    d, h = cfg.dsa, cfg.hidden_size
    t: dict[str, TensorTarget] = {}

    def whole(name: str, param: str, *shape: int, float32: bool = False) -> None:
        t[name] = TensorTarget(param, 0, 0, None, shape, float32)

    def mlp(hf: str, me: str, size: int) -> None:
        t.update(sharded_mlp(hf, me, size, h, rank, tp))

    whole("model.embed_tokens.weight", "embed_tokens.weight", cfg.vocab_size, h)
    whole("model.norm.weight", "norm.weight", h)
    if not cfg.tie_word_embeddings:
        whole("lm_head.weight", "lm_head.weight", cfg.vocab_size, h)
    heads = cfg.num_heads
    for i in range(cfg.num_layers):
        hf, me = f"model.layers.{i}.", f"layers.{i}."
        whole(hf + "input_layernorm.weight", me + "input_layernorm.weight", h)
        whole(hf + "post_attention_layernorm.weight", me + "post_attention_layernorm.weight", h)
        a, m = hf + "self_attn.", me + "self_attn."
        for name, shape in (("q_a_proj.weight", (d.q_lora_rank, h)), ("q_a_layernorm.weight", (d.q_lora_rank,)),
                            ("q_b_proj.weight", (heads * d.qk_head_dim, d.q_lora_rank)),
                            ("kv_a_proj_with_mqa.weight", (d.latent_dim, h)),
                            ("kv_a_layernorm.weight", (d.kv_lora_rank,)),
                            ("kv_b_proj.weight", (heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank)),
                            ("o_proj.weight", (h, heads * d.v_head_dim))):
            whole(a + name, m + name, *shape)
        if cfg.attention_bias:
            whole(a + "q_a_proj.bias", m + "q_a_proj.bias", d.q_lora_rank)
            whole(a + "kv_a_proj_with_mqa.bias", m + "kv_a_proj_with_mqa.bias", d.latent_dim)
        if cfg.o_bias:
            whole(a + "o_proj.bias", m + "o_proj.bias", h)
        if d.indexer_layers[i]:
            for name, shape in (("wq_b.weight", (d.index_n_heads * d.index_head_dim, d.q_lora_rank)),
                                ("wk.weight", (d.index_head_dim, h)), ("k_norm.weight", (d.index_head_dim,)),
                                ("k_norm.bias", (d.index_head_dim,)), ("weights_proj.weight", (d.index_n_heads, h))):
                whole(a + "indexer." + name, m + "indexer." + name, *shape)
        if not d.is_moe(i):
            mlp(hf + "mlp.", me + "mlp.", cfg.intermediate_size)
            continue
        m = d.moe
        whole(hf + "mlp.gate.weight", me + "mlp.router.weight", m.num_experts, h, float32=True)
        whole(hf + "mlp.gate.e_score_correction_bias", me + "mlp.router.e_score_correction_bias", m.num_experts,
              float32=True)
        if m.shared_intermediate_size:
            mlp(hf + "mlp.shared_experts.", me + "mlp.shared.", m.shared_intermediate_size)
        t.update(expert_targets(f"{hf}mlp.experts.", me + "mlp.experts.", m.num_experts, m.intermediate_size, h,
                                 rank, tp, moe))
    return t


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded Hub-named tensors of every shape the table lists (the presets' writer):
    matrices std fan_in ** -0.5 (indexer scores and router logits of order 1: with
    small weights they crowd together and a float32 rounding flips a top-k choice),
    norms near 1, biases near 0; routers in float32 as transformers keeps them."""
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[cfg.torch_dtype or "float32"]
    out = {}
    for name, t in dsa_tensors(cfg, 0, 1).items():
        noise = torch.randn(t.shape, generator=g)
        if len(t.shape) == 2:
            w = noise * t.shape[1] ** -0.5
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            w = 1.0 + 0.1 * noise
        else:  # biases (the indexer's LayerNorm, the router's correction)
            w = 0.02 * noise
        out[name] = w if t.float32 else w.to(dtype)
    return out
