"""One DeepSeek V4 attention layer on this rank's rows (docs/dsv4.md).

Inside the captured segments (static shapes): the query (``q_a_proj`` -> norm ->
``q_b_proj`` -> per-head RMS -> RoPE), the window row (``kv_proj`` -> norm -> RoPE), a
compressed layer's source rows (its compressor's kv and gate projections, a CSA
layer's indexer's too) and the indexer's query and head weights; then the exchange:
every rank's window and source rows all-gathered and written to the cache (one
collective a layer). The attention break (``graphcp/model/dsv4/sparse.py``) pools
the entries the batch closes, selects and attends this rank's rows; after it the
output's RoPE is undone and the grouped low-rank output projection runs.
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.model.config import ModelConfig
from graphcp.model.cp_attention import attend_own, store_rows
from graphcp.model.dsv4.cache import CSA, HCA
from graphcp.model.dsv4.norms import V4RMSNorm, unweighted_rms
from graphcp.model.dsv4.rope import V4Rotary
from graphcp.model.dsv4.sparse import PoolWeights
from graphcp.model.forward_context import ForwardContext
from graphcp.model.graph_break import graph_break
from graphcp.model.heads import HeadShard, head_shard
from graphcp.model.indexed_break import break_rows
from graphcp.model.indexed_break import static_rows as indexed_rows
from graphcp.nvtx_ranges import nvtx_range


def attend_v4(ctx: ForwardContext, layer: int, q: torch.Tensor, index_q: torch.Tensor | None,
              index_w: torch.Tensor | None, sinks: torch.Tensor, weights: PoolWeights | None,
              out: torch.Tensor) -> None:
    """The attention break, where the forward's phase runs it (graphcp.model.cp_attention.
    attend_own): in a prefill on a cache that keeps only some layers (LayerSplit), after
    the batch's cached-prefix pages of this layer's pools are fetched from their owner; in
    a decode step on that cache, on the owner (its pools pool and attend), which
    broadcasts the output."""
    backend = ctx.kv.backend
    with nvtx_range(f"attention[{layer}]", category="break"):
        attend_own(ctx, layer,
                   lambda: backend.forward(layer, q, index_q, index_w, sinks, ctx.kv.cache.storage, weights, out),
                   (out,))


run_v4_attention = graph_break("attention")(attend_v4)


class Compressor(nn.Module):
    """A compressed layer's pooling weights (``width`` per series; CSA: two series)."""

    def __init__(self, hidden: int, width: int, rate: int, series: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.kv_proj = nn.Linear(hidden, series * width, bias=False, dtype=dtype)
        self.gate_proj = nn.Linear(hidden, series * width, bias=False, dtype=dtype)
        self.position_bias = nn.Parameter(torch.empty(rate, series * width, dtype=torch.float32), requires_grad=False)
        self.kv_norm = V4RMSNorm(width, eps)

    def sources(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.kv_proj(x), self.gate_proj(x)]


class V4Attention(nn.Module):
    """One layer's attention over this rank's query heads (``shard``; all of them at
    attention TP 1): the one KV head, the compressors and the indexer whole on every
    rank; the output projection over its heads' groups, its partial sums all-reduced."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, shard: HeadShard | None = None) -> None:
        super().__init__()
        d = self.v4 = cfg.dsv4
        self.shard = shard = shard or head_shard(cfg)
        self.layer, self.heads, self.eps = layer, shard.num_heads, cfg.rms_norm_eps
        self.groups = d.o_groups * shard.num_heads // cfg.num_heads  # this rank's head groups
        self.kind = d.layer_kinds[layer]
        self.rope = V4Rotary.kind_of(self.kind)
        h, hd = cfg.hidden_size, d.head_dim
        self.q_a_proj = nn.Linear(h, d.q_lora_rank, bias=False, dtype=dtype)
        self.q_a_norm = V4RMSNorm(d.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(d.q_lora_rank, self.heads * hd, bias=False, dtype=dtype)
        self.kv_proj = nn.Linear(h, hd, bias=False, dtype=dtype)
        self.kv_norm = V4RMSNorm(hd, cfg.rms_norm_eps)
        # grouped low-rank output: each of o_groups head groups to o_lora_rank, then mixed
        self.o_a_proj = nn.Linear(cfg.num_heads * hd // d.o_groups, self.groups * d.o_lora_rank, bias=False,
                                  dtype=dtype)
        self.o_b_proj = nn.Linear(self.groups * d.o_lora_rank, h, bias=False, dtype=dtype)
        self.sinks = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False)
        self.compressor = self.indexer = None
        if self.kind == CSA:
            self.compressor = Compressor(h, hd, d.compress_csa, 2, cfg.rms_norm_eps, dtype)
            self.indexer = Compressor(h, d.index_head_dim, d.compress_csa, 2, cfg.rms_norm_eps, dtype)
            self.index_q_proj = nn.Linear(d.q_lora_rank, d.index_n_heads * d.index_head_dim, bias=False, dtype=dtype)
            self.index_weights_proj = nn.Linear(h, d.index_n_heads, bias=False, dtype=dtype)
        elif self.kind == HCA:
            self.compressor = Compressor(h, hd, d.compress_hca, 1, cfg.rms_norm_eps, dtype)

    def pool_weights(self) -> PoolWeights | None:
        c, i = self.compressor, self.indexer
        if c is None:
            return None
        return PoolWeights(c.position_bias, c.kv_norm.weight, None if i is None else i.position_bias,
                           None if i is None else i.kv_norm.weight)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: V4Rotary, ctx: ForwardContext):
        q, index_q, index_w, out = self.prepare(x, positions, rotary, ctx)
        run_v4_attention(ctx, self.layer, q, index_q, index_w, self.sinks, self.pool_weights(), out)
        return self.project(out, positions, rotary, ctx)

    def prepare(self, x: torch.Tensor, positions: torch.Tensor, rotary: V4Rotary, ctx: ForwardContext):
        """Everything before the break: projections, RoPE, the exchange and cache write;
        -> the query, the indexer's query and head weights (None outside CSA) and the
        rows attention writes."""
        d, n = self.v4, x.shape[0]
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms(self.q_b_proj(q_resid).view(n, self.heads, d.head_dim), self.eps)
        q = rotary.rotate(q, positions, self.rope)
        rows = [rotary.rotate(self.kv_norm(self.kv_proj(x)), positions, self.rope)]
        index_q = index_w = None
        if self.compressor is not None:
            rows += self.compressor.sources(x)
        if self.indexer is not None:
            rows += self.indexer.sources(x)
            index_q = rotary.rotate(self.index_q_proj(q_resid).view(n, d.index_n_heads, d.index_head_dim),
                                    positions, self.rope)
            index_w = self.index_weights_proj(x).float() * d.index_n_heads ** -0.5
        store_rows(ctx, self.layer, torch.cat(rows, dim=-1))
        return break_rows(ctx, q, index_q, index_w, (self.heads, d.head_dim))

    def project(self, out: torch.Tensor, positions: torch.Tensor, rotary: V4Rotary,
                ctx: ForwardContext) -> torch.Tensor:
        """Undo RoPE on the output's rope slice (K = V carried it), then the grouped output
        projection of this rank's groups (row-parallel under attention TP: all-reduced)."""
        d, n = self.v4, out.shape[0]
        o = rotary.rotate(out, positions, self.rope, inverse=True).reshape(n, self.groups, -1)
        w = self.o_a_proj.weight.view(self.groups, d.o_lora_rank, -1).transpose(1, 2)  # [G, in, rank]
        grouped = torch.bmm(o.transpose(0, 1), w).transpose(0, 1)  # [n, G, rank]
        y = self.o_b_proj(grouped.flatten(1))
        return ctx.comm.reduce_attention(y) if self.shard.split else y


def static_rows(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The attention break's static rows (per row shape and dtype) for graph mode
    (``cfg``: with this rank's head counts)."""
    d = cfg.dsv4
    index_heads = d.index_n_heads if CSA in d.layer_kinds else None
    return indexed_rows(cfg.num_heads, d.head_dim, d.head_dim, index_heads, d.index_head_dim, dtype)
