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

from graphcp.config import ModelConfig
from graphcp.model.dsa.mla import MlaAttention, static_rows
from graphcp.model.dsa.moe import DeepseekMoe
from graphcp.model.dsa.rope import DsaRotary
from graphcp.model.layers import ParallelMLP, RMSNorm
from graphcp.model.llama import DecoderModel
from graphcp.model.moe.experts import grouped_mm_capturable
from graphcp.options import MoeLayout


class DsaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.dsa
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MlaAttention(cfg, layer, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.exchanges = False  # no expert-parallel exchange (DecoderModel.exchanges)
        if d.is_moe(layer):
            self.mlp = DeepseekMoe(d.moe, cfg.hidden_size, tp_size, dtype)
        else:  # transformers' DeepseekV32MLP has no biases, whatever mlp_bias says
            self.mlp = ParallelMLP(cfg.hidden_size, cfg.intermediate_size, tp_size, False, dtype)

    def forward(self, h, positions, rotary, ctx):
        h = h + self.self_attn(self.input_layernorm(h), positions, rotary, ctx)
        return h + self.mlp(self.post_attention_layernorm(h), ctx.group)


class DsaModel(DecoderModel):
    """DecoderModel's body and LM head with DSA layers and their RoPE tables."""

    def make_layer(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype, rank: int,
                   moe: MoeLayout) -> nn.Module:
        # DeepSeek MoE runs the tp layout only (graphcp/model/dsa/runtime.py refuses moe='ep')
        return DsaLayer(cfg, layer, tp_size, dtype)

    @staticmethod
    def make_rotary(cfg: ModelConfig, max_positions: int | None = None) -> nn.Module:
        return DsaRotary(cfg.dsa.qk_rope_head_dim, max_positions or cfg.max_position_embeddings, cfg.rope)

    def static_rows(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-row shapes and dtypes of the static rows the attention breaks read and write."""
        return static_rows(self.cfg, self.dtype)

    def static_stats(self, rows: int) -> dict:
        return {}  # the indexer's figures come from the attention backend (forward_stats)

    def capture_problem(self, device: torch.device, full: bool) -> str | None:
        moe = any(isinstance(layer.mlp, DeepseekMoe) for layer in self.layers)
        if moe and not grouped_mm_capturable(device, self.dtype):
            return (f"DeepSeek MoE keeps its experts inside the captured graphs, which needs torch._grouped_mm's "
                    f"sync-free kernel (bfloat16 on sm90/sm100); {self.dtype} on {device} copies the group sizes "
                    "to the host: use dtype='bfloat16' or graph='off'")
        return None
