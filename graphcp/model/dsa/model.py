"""The decoder of the DSA families (DeepSeek V3.2, GLM-5).

Per layer, on this rank's rows only:
  norm -> MLA projections + indexer projections -> latent / indexer-key exchange + cache
  write -> indexer top-k + sparse attention (a graph break) -> o_proj -> residual -> norm
  -> dense MLP (the first ``first_k_dense_replace`` layers, tensor-parallel over the CP
  group) or DeepSeek MoE (the SparseMoeBlock of ``graphcp/model/moe/`` with the grouped
  sigmoid router and a shared expert, ``--moe ep|tp``) -> residual
Attention weights (and the indexer's) are whole on every rank. With ``--moe ep`` a MoE
layer runs o_proj, the norm and the expert exchange in the attention break, as the
Llama family's MoE layers do (:class:`~graphcp.model.llama.ExpertParallelTail`).
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.model.config import ModelConfig
from graphcp.model.dsa.mla import MlaAttention, run_sparse_mla_moe, static_rows
from graphcp.model.dsa.rope import DsaRotary
from graphcp.model.layers import ParallelMLP, RMSNorm
from graphcp.model.llama import DecoderModel, ExpertParallelTail
from graphcp.model.moe.block import SparseMoeBlock
from graphcp.options import MoeLayout


class DsaLayer(ExpertParallelTail):
    def __init__(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype, rank: int,
                 moe: MoeLayout) -> None:
        super().__init__()
        d = cfg.dsa
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MlaAttention(cfg, layer, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if d.is_moe(layer):
            self.mlp = SparseMoeBlock(d.moe, cfg.hidden_size, moe, rank, tp_size, dtype)
        else:  # transformers' DeepseekV32MLP has no biases, whatever mlp_bias says
            self.mlp = ParallelMLP(cfg.hidden_size, cfg.intermediate_size, tp_size, False, dtype)
        #: experts split over the ranks: the all-to-all exchange runs in the attention break
        self.exchanges = isinstance(self.mlp, SparseMoeBlock) and moe == "ep"

    def forward(self, h, positions, rotary, ctx):
        if self.exchanges:
            attn = self.self_attn
            q, index_q, index_w, attn_out = attn.prepare(self.input_layernorm(h), positions, rotary, ctx)
            resid, out = self.break_rows(h, ctx)
            run_sparse_mla_moe(ctx, self.layer, self, q, index_q, index_w, attn.kv_b_proj.weight, attn_out, resid,
                               out)
            return out
        h = h + self.self_attn(self.input_layernorm(h), positions, rotary, ctx)
        return h + self.mlp(self.post_attention_layernorm(h), ctx.comm)


class DsaModel(DecoderModel):
    """DecoderModel's body and LM head with DSA layers and their RoPE tables."""

    def make_layer(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype, rank: int,
                   moe: MoeLayout) -> nn.Module:
        return DsaLayer(cfg, layer, tp_size, dtype, rank, moe)

    @staticmethod
    def make_rotary(cfg: ModelConfig, max_positions: int | None = None) -> nn.Module:
        return DsaRotary(cfg.dsa.qk_rope_head_dim, max_positions or cfg.max_position_embeddings, cfg.rope)

    def static_rows(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-row shapes and dtypes of the static rows the attention breaks read and write."""
        return static_rows(self.cfg, self.dtype)
