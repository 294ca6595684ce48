"""The decoder of the DSA families (DeepSeek V3.2, GLM-5).

Per layer, on this rank's rows only:
  norm -> MLA projections + indexer projections -> latent / indexer-key exchange + cache
  write -> indexer top-k + sparse attention (a graph break) -> o_proj -> residual -> norm
  -> dense MLP (the first ``first_k_dense_replace`` layers) or DeepSeek MoE, both
  tensor-parallel over the CP group -> residual
Attention weights (and the indexer's) are whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.attention.exchange import gather_kv_slots
from graphcp.config import ModelConfig
from graphcp.forward_context import ForwardContext
from graphcp.model.dsa.mla import MlaAttention, static_rows
from graphcp.model.dsa.moe import DeepseekMoe
from graphcp.model.dsa.rope import DsaRotary
from graphcp.model.layers import ParallelMLP, RMSNorm
from graphcp.profile.ranges import nvtx_range


class DsaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.dsa
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MlaAttention(cfg, layer, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if d.is_moe(layer):
            self.mlp = DeepseekMoe(d.moe, cfg.hidden_size, tp_size, dtype)
        else:  # transformers' DeepseekV32MLP has no biases, whatever mlp_bias says
            self.mlp = ParallelMLP(cfg.hidden_size, cfg.intermediate_size, tp_size, False, dtype)

    def forward(self, h, positions, rotary, ctx):
        h = h + self.self_attn(self.input_layernorm(h), positions, rotary, ctx)
        return h + self.mlp(self.post_attention_layernorm(h), ctx.group)


class DsaModel(nn.Module):
    """The body (embedding -> layers -> final norm) and the LM head."""

    def __init__(self, cfg: ModelConfig, tp_size: int, dtype: torch.dtype, max_positions: int | None = None):
        super().__init__()
        self.cfg, self.tp_size, self.dtype = cfg, tp_size, dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DsaLayer(cfg, i, tp_size, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                      dtype=dtype)
        self.rotary = make_rotary(cfg, max_positions)
        for p in self.parameters():
            p.requires_grad_(False)

    def body(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Local rows in, final-normed hidden states of the same rows out."""
        gather_kv_slots(ctx)
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            with nvtx_range(f"layer[{i}]", category="eager"):
                h = layer(h, positions, self.rotary, ctx)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.matmul(hidden, w.t()).float()

    def static_rows(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-row shapes and dtypes of the static rows the attention breaks read and write."""
        return static_rows(self.cfg, self.dtype)


def make_rotary(cfg: ModelConfig, max_positions: int | None = None) -> DsaRotary:
    """The RoPE tables (computed, never loaded: the loader rebuilds them on the device)."""
    return DsaRotary(cfg.dsa.qk_rope_head_dim, max_positions or cfg.max_position_embeddings, cfg.rope)
