"""One decoder for the Llama family: Llama (incl. llama3 RoPE scaling), Mistral,
Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm, explicit head_dim).

Per layer, on this rank's rows only:
  norm -> fused qkv -> (q/k norm) -> RoPE -> KV exchange + cache write
  -> attention (a graph break) -> o_proj -> residual -> norm -> CP = TP MLP -> residual
Attention weights are whole on every rank; the MLP is sharded over the CP group.
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.attention.exchange import exchange_and_write_kv, gather_kv_slots
from graphcp.config import ModelConfig
from graphcp.forward_context import ForwardContext
from graphcp.graph_break import graph_break
from graphcp.model.layers import ParallelMLP, RMSNorm, Rotary
from graphcp.profile.ranges import nvtx_range


@graph_break("attention")
def run_attention(ctx: ForwardContext, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
    """Attend this rank's query rows over the cache; writes ``out`` in place. A cache
    that keeps only some layers (LayerSplit) first fetches the batch's cached-prefix
    pages of this layer from their owner (the live batch's pages: in the break)."""
    with nvtx_range(f"attention[{layer}]", category="break"):
        if ctx.prefix_pages is not None:
            ctx.kv_cache.fetch_prefix(layer, ctx.prefix_pages, ctx.group)
        ctx.attention.forward(q, ctx.kv_cache.layer(layer), ctx.attn_meta, out)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = layer
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, ctx: ForwardContext):
        cfg, n = self.cfg, x.shape[0]
        q, k, v = self.qkv(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k, positions)
        exchange_and_write_kv(ctx, self.layer, k, v)
        if ctx.attn_q is not None:
            q = ctx.attn_q.copy_(q)
            out = ctx.attn_out
        else:
            out = torch.empty_like(q)
        run_attention(ctx, self.layer, q, out)
        return self.o_proj(out.view(n, cfg.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = ParallelMLP(cfg.hidden_size, cfg.intermediate_size, tp_size, cfg.mlp_bias, dtype)

    def forward(self, h, positions, rotary, ctx):
        h = h + self.self_attn(self.input_layernorm(h), positions, rotary, ctx)
        return h + self.mlp(self.post_attention_layernorm(h), ctx.group)


class DecoderModel(nn.Module):
    """The body (embedding -> layers -> final norm) and the LM head."""

    def __init__(self, cfg: ModelConfig, tp_size: int, dtype: torch.dtype, max_positions: int | None = None):
        super().__init__()
        self.cfg, self.tp_size, self.dtype = cfg, tp_size, dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp_size, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.rotary = Rotary(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope)
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
