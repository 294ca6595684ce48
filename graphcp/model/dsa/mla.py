"""MLA (multi-head latent attention) with the DSA lightning indexer, on this rank's rows.

Per layer, as transformers computes it:

  q_resid = q_a_layernorm(q_a_proj(x))                     the query latent
  q       = q_b_proj(q_resid) -> [nope | rope] per head    rope part: interleaved RoPE
  latent, k_rope = kv_a_proj_with_mqa(x)                   latent: kv_a_layernorm; k_rope: RoPE
  indexer: q_I = wq_b(q_resid), k_I = LayerNorm(wk(x)) (RoPE on their first rope dims),
           w_I = weights_proj(x) * H_I ** -0.5

then the exchange (every rank's latent, rope key and indexer key all-gathered and
written to the cache: one collective a layer, a token's ``kv_lora + rope + D_I``
values), and the attention break: the indexer's top-k and sparse attention over it
(``graphcp/model/dsa/sparse.py``) for this rank's rows; ``o_proj`` after it.

Why a break: the selection has a static shape (``[rows, index_topk]``) but which keys a
row may see and how many depend on the live batch (its segments), read on the host,
as for attention itself; so the indexer's scoring, the top-k and the sparse attention
run together in the break, everything before (projections, RoPE, the exchange) inside
the captured graphs.
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.model.config import ModelConfig
from graphcp.model.cp_attention import attend_own, store_rows
from graphcp.model.dsa.rope import DsaRotary, rope_half_split, rope_interleaved
from graphcp.model.forward_context import ForwardContext
from graphcp.model.graph_break import graph_break
from graphcp.model.indexed_break import break_rows
from graphcp.model.indexed_break import static_rows as indexed_rows
from graphcp.model.layers import RMSNorm
from graphcp.model.llama import ExpertParallelTail
from graphcp.nvtx_ranges import nvtx_range

#: transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, whatever rms_norm_eps says
LATENT_NORM_EPS = 1e-6
#: the indexer's key LayerNorm eps (transformers: nn.LayerNorm(index_head_dim, eps=1e-6))
INDEX_NORM_EPS = 1e-6


def attend_sparse(ctx: ForwardContext, layer: int, q: torch.Tensor, index_q: torch.Tensor | None,
                  index_w: torch.Tensor | None, kv_b_weight: torch.Tensor, out: torch.Tensor) -> None:
    """The indexer's top-k and sparse MLA attention of this rank's rows; writes ``out``,
    where the forward's phase runs it (graphcp.model.cp_attention.attend_own): in a
    prefill, on a cache that keeps only some layers (LayerSplit), after the batch's
    cached-prefix pages of this layer (latent and indexer keys) are fetched from their
    owner; in a decode step on that cache, on the owner, which broadcasts the output (and
    the selection a GLM 'shared' layer reuses)."""
    backend = ctx.kv.backend
    with nvtx_range(f"attention[{layer}]", category="break"):
        attend_own(ctx, layer,
                   lambda: backend.forward(layer, q, index_q, index_w, kv_b_weight, ctx.kv.cache.storage, out),
                   (out, *backend.carried(layer, q)))


run_sparse_mla = graph_break("attention")(attend_sparse)


@graph_break("attention+moe")
def run_sparse_mla_moe(ctx: ForwardContext, layer: int, block: ExpertParallelTail, q: torch.Tensor,
                       index_q: torch.Tensor | None, index_w: torch.Tensor | None, kv_b_weight: torch.Tensor,
                       attn_out: torch.Tensor, resid: torch.Tensor, out: torch.Tensor) -> None:
    """Sparse attention, then the rest of a layer whose experts are split over the ranks
    (o_proj, residual, norm, the expert-parallel MoE): the layer's rows into ``out``."""
    attend_sparse(ctx, layer, q, index_q, index_w, kv_b_weight, attn_out)
    block.after_attention(ctx, attn_out, resid, out)


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.dsa
        self.heads, self.dim, self.rope_dim = d.index_n_heads, d.index_head_dim, d.qk_rope_head_dim
        self.rotate = rope_interleaved if d.indexer_rope_interleaved else rope_half_split
        self.wq_b = nn.Linear(d.q_lora_rank, d.index_n_heads * d.index_head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(cfg.hidden_size, d.index_head_dim, bias=False, dtype=dtype)
        self.k_norm = nn.LayerNorm(d.index_head_dim, eps=INDEX_NORM_EPS, dtype=dtype)
        self.weights_proj = nn.Linear(cfg.hidden_size, d.index_n_heads, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> query ``[n, H_I, D_I]``, key ``[n, D_I]`` (both rotated) and head weights ``[n, H_I]`` float32."""
        n, r = x.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(n, self.heads, self.dim)
        q = torch.cat([self.rotate(q[..., :r], cos.unsqueeze(1), sin.unsqueeze(1)), q[..., r:]], dim=-1)
        k = self.k_norm(self.wk(x))
        k = torch.cat([self.rotate(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        return q, k, self.weights_proj(x).float() * self.heads ** -0.5


class MlaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        d = self.dsa = cfg.dsa
        self.layer, self.heads = layer, cfg.num_heads
        bias = cfg.attention_bias
        self.q_a_proj = nn.Linear(cfg.hidden_size, d.q_lora_rank, bias=bias, dtype=dtype)
        self.q_a_layernorm = RMSNorm(d.q_lora_rank, LATENT_NORM_EPS, dtype)
        self.q_b_proj = nn.Linear(d.q_lora_rank, cfg.num_heads * d.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, d.latent_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = nn.Linear(d.kv_lora_rank, cfg.num_heads * (d.qk_nope_head_dim + d.v_head_dim), bias=False,
                                   dtype=dtype)
        self.o_proj = nn.Linear(cfg.num_heads * d.v_head_dim, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)
        # a GLM "shared" layer has no indexer: it reuses the last indexer layer's top-k
        self.indexer = Indexer(cfg, dtype) if d.indexer_layers[layer] else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: DsaRotary, ctx: ForwardContext):
        q, index_q, index_w, out = self.prepare(x, positions, rotary, ctx)
        run_sparse_mla(ctx, self.layer, q, index_q, index_w, self.kv_b_proj.weight, out)
        return self.project(out.view(x.shape[0], -1), ctx)

    def project(self, attn: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """o_proj (every head on every rank: DSA models keep attention TP 1)."""
        return self.o_proj(attn)

    def prepare(self, x: torch.Tensor, positions: torch.Tensor, rotary: DsaRotary, ctx: ForwardContext):
        """Everything before the attention break: projections, RoPE, the exchange and
        cache write; -> the MLA query rows, the indexer's query and head weights (None
        in a layer that reuses the last selection) and the rows attention writes."""
        d, n = self.dsa, x.shape[0]
        cos, sin = rotary(positions, x.dtype)
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q_nope, q_rope = self.q_b_proj(q_resid).view(n, self.heads, d.qk_head_dim).split(
            [d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, rope_interleaved(q_rope, cos.unsqueeze(1), sin.unsqueeze(1))], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        rows = [self.kv_a_layernorm(latent), rope_interleaved(k_rope, cos, sin)]
        index_q = index_w = None
        if self.indexer is not None:
            index_q, index_k, index_w = self.indexer(x, q_resid, cos, sin)
            rows.append(index_k)
        store_rows(ctx, self.layer, torch.cat(rows, dim=-1))
        return break_rows(ctx, q, index_q, index_w, (self.heads, d.v_head_dim))


def static_rows(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The attention break's static rows (per row shape and dtype) for graph mode."""
    d = cfg.dsa
    return indexed_rows(cfg.num_heads, d.qk_head_dim, d.v_head_dim, d.index_n_heads, d.index_head_dim, dtype)
