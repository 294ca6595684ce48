"""MLA without positional encoding, on this rank's rows: Kimi Linear's full layers (and,
with GLM-5-Next's pooled indexer, its indexed layers):

  q = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x)))   [nope | rope slice] a head
  latent, k_rope = kv_a_proj_with_mqa(x)                     latent: kv_a_layernorm

No RoPE: the ``qk_rope_head_dim`` slices of the query and the shared key are used as
they are (transformers' Kimi keeps them, unrotated; GLM-5-Next has none). Then the DSA
family's exchange and break (graphcp.model.dsa.mla): every rank's ``latent | k_rope``
rows (and an indexer's) all-gathered into the cache, and in the attention break the
backend attends each of this rank's rows over its request's latent rows (keys and
values decompressed by ``kv_b_proj``): densely (every earlier token), or over the pooled
indexer's selection.
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.model.cp_attention import store_rows
from graphcp.model.dsa.mla import run_sparse_mla
from graphcp.model.forward_context import ForwardContext
from graphcp.model.indexed_break import break_rows
from graphcp.model.indexed_break import static_rows as indexed_rows
from graphcp.model.kimi_linear.config import LatentConfig
from graphcp.model.layers import RMSNorm


class LatentAttention(nn.Module):
    """``indexer``: a module ``(x, q_resid) -> (index_q, index_w, cache rows)`` run with
    the projections (GLM-5-Next's), or None (attention over every earlier token)."""

    def __init__(self, latent: LatentConfig, hidden: int, heads: int, layer: int, dtype: torch.dtype, bias: bool,
                 indexer: nn.Module | None = None) -> None:
        super().__init__()
        m = self.latent = latent
        self.layer, self.heads = layer, heads
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * m.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, m.norm_eps, dtype)
            self.q_b_proj = nn.Linear(m.q_lora_rank, heads * m.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.latent_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, m.norm_eps, dtype)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False,
                                   dtype=dtype)
        self.o_proj = nn.Linear(heads * m.v_head_dim, hidden, bias=bias, dtype=dtype)
        self.indexer = indexer
        for p in self.parameters():
            p.requires_grad_(False)

    def query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The query rows ``[n, H, qk_head_dim]`` and the query latent (None without q_lora_rank)."""
        if self.latent.q_lora_rank is None:
            return self.q_proj(x).view(x.shape[0], self.heads, -1), None
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        return self.q_b_proj(q_resid).view(x.shape[0], self.heads, -1), q_resid

    def prepare(self, x: torch.Tensor, ctx: ForwardContext):
        """Everything before the attention break: the projections, the exchange and cache
        write; -> the query rows, the indexer's query and head weights (None without one)
        and the rows attention writes."""
        m = self.latent
        q, q_resid = self.query(x)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        rows = [self.kv_a_layernorm(latent), k_rope]
        index_q = index_w = None
        if self.indexer is not None:
            index_q, index_w, index_rows = self.indexer(x, q_resid)
            rows.append(index_rows)
        store_rows(ctx, self.layer, torch.cat(rows, dim=-1))
        return break_rows(ctx, q, index_q, index_w, (self.heads, m.v_head_dim))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, index_q, index_w, out = self.prepare(x, ctx)
        run_sparse_mla(ctx, self.layer, q, index_q, index_w, self.kv_b_proj.weight, out)
        return self.project(out.view(x.shape[0], -1), ctx)

    def project(self, attn: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """o_proj (every head on every rank)."""
        return self.o_proj(attn)


def static_rows(latent: LatentConfig, heads: int, dtype: torch.dtype, index_heads: int | None = None,
                index_dim: int = 0) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The attention break's static rows (per row shape and dtype) for graph mode."""
    return indexed_rows(heads, latent.qk_head_dim, latent.v_head_dim, index_heads, index_dim, dtype)
