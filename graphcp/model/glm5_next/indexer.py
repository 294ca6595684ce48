"""GLM-5-Next's lightning indexer over pooled token groups (``Glm5NextTextIndexer``).

Before the break, per token (this rank's rows): the indexer's query ``wq_b(q_resid)``
``[H_I, D]``, its head weights ``weights_proj(x) H_I ** -0.5`` (float32), and the rows
the cache keeps beside the latent: the key ``LayerNorm(wk(x))`` and the pooling gate
``index_kpool_compress_gate x`` (``2 D`` values a token; no RoPE).

In the attention break, per request (the DSA family's sparse attention,
graphcp.model.dsa.sparse, with :meth:`PooledSparseMla.choose` for its selection): the
request's tokens cut into pools of ``kpool`` from its first token (the gathered rows, so
a pool may straddle two ranks' blocks); a complete pool's key is the average of its
tokens' keys weighted per channel by ``softmax(gate + ape)`` over the pool; a row scores
the pools that end at or before it like DSA's tokens (``sum_h w_h relu(q_h . k / sqrt
D)``), keeps the best ``topk / kpool`` (ties: the earliest; a masked pool is never
kept) and reads their tokens plus its own incomplete pool's. A row that sees at most
``topk / kpool`` complete pools reads every token before it (dense), as transformers'
selection of all its pools does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphcp.attention.base import AttentionMetadata
from graphcp.model.dsa.cache import MlaStorage
from graphcp.model.dsa.mla import INDEX_NORM_EPS
from graphcp.model.dsa.sparse import SparseMlaSpec, TorchSparseMla
from graphcp.model.dsa.sparse_decode import PagedSparseMlaDecode
from graphcp.model.dsa.topk import index_scores, mask_to_positions, select_topk
from graphcp.model.glm5_next.config import PooledIndexer


class Glm5Indexer(nn.Module):
    def __init__(self, ix: PooledIndexer, hidden: int, q_lora_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.dim = ix.n_heads, ix.head_dim
        self.wq_b = nn.Linear(q_lora_rank, ix.n_heads * ix.head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(hidden, ix.head_dim, bias=False, dtype=dtype)
        self.k_norm = nn.LayerNorm(ix.head_dim, eps=INDEX_NORM_EPS, dtype=dtype)
        self.weights_proj = nn.Linear(hidden, ix.n_heads, bias=False, dtype=dtype)
        # (transformers adds it in float32: a model-dtype value held exactly)
        self.ape = nn.Parameter(torch.empty(ix.kpool, ix.head_dim, dtype=torch.float32))
        self.gate = nn.Parameter(torch.empty(ix.head_dim, hidden, dtype=dtype))
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor):
        """-> query ``[n, H_I, D]``, head weights ``[n, H_I]`` float32 and the cache rows
        ``[n, 2 D]`` (key | pooling gate)."""
        q = self.wq_b(q_resid).view(x.shape[0], self.heads, self.dim)
        rows = torch.cat([self.k_norm(self.wk(x)), F.linear(x, self.gate)], dim=-1)
        return q, self.weights_proj(x).float() * self.heads ** -0.5, rows


def pool_keys(rows: torch.Tensor, ape: torch.Tensor, kpool: int) -> torch.Tensor:
    """The complete pools' keys ``[..., n // kpool, D]`` of a request's indexer rows ``[...,
    n, 2 D]`` (from its first token), in transformers' order of operations: float32
    softmax weights cast to the keys' dtype, the weighted keys summed in it."""
    d = rows.shape[-1] // 2
    n = rows.shape[-2] // kpool * kpool
    keys, gates = rows[..., :n, :d].unflatten(-2, (-1, kpool)), rows[..., :n, d:].unflatten(-2, (-1, kpool))
    weights = (gates.float() + ape.float()).softmax(dim=-2).to(keys.dtype)
    return (weights * keys).sum(dim=-2)


def pooled_selection(index_q: torch.Tensor, index_w: torch.Tensor, rows: torch.Tensor, ape: torch.Tensor,
                     pos: torch.Tensor, ix: PooledIndexer) -> torch.Tensor:
    """The token positions ``[R, width]`` (ascending, -1 padded) rows at positions ``pos``
    read: their best ``topk / kpool`` visible pools' tokens and their own incomplete
    pool's. ``rows``: the request's indexer rows ``[kv, 2 D]`` (at least up to the last
    row's position), or each row's own request's ``[R, kv, 2 D]`` (a decode step's)."""
    kv, P, R = rows.shape[-2], ix.kpool, pos.shape[0]
    pools = pool_keys(rows, ape, P)
    n = pools.shape[-2]
    scores = index_scores(index_q, index_w, pools, ix.head_dim ** -0.5)  # [R, pools]
    ends = torch.arange(n, device=pos.device) * P + (P - 1)
    visible = ends.unsqueeze(0) <= pos.unsqueeze(1)
    best = select_topk(scores.masked_fill(~visible, float("-inf")), ix.pools)
    chosen = torch.zeros(R, n + 1, dtype=torch.bool, device=pos.device)
    chosen.scatter_(1, torch.where(best < 0, n, best), True)
    tokens = chosen[:, :n].repeat_interleave(P, dim=1)
    tokens = torch.cat([tokens, tokens.new_zeros(R, kv - n * P)], dim=1)
    t = torch.arange(kv, device=pos.device).unsqueeze(0)
    start = (pos + 1 - (pos + 1) % P).unsqueeze(1)  # the row's incomplete pool: [start, pos]
    tail = (t >= start) & (t <= pos.unsqueeze(1))
    sel = mask_to_positions(tokens | tail, ix.width)
    return F.pad(sel, (0, ix.width - sel.shape[1]), value=-1)  # (fewer tokens than the width: -1 padded)


class PooledSparseMla(TorchSparseMla):
    """The DSA family's torch sparse-MLA reference with GLM-5-Next's pooled selection
    (``spec.index_topk`` is the selection's width, ``topk + kpool - 1``: the rows that
    see fewer tokens are exactly those that read every token before them).
    ``indexers``: layer -> its :class:`Glm5Indexer` (their ``ape``)."""

    name = "torch"

    def __init__(self, spec: SparseMlaSpec, ix: PooledIndexer, indexers: dict[int, Glm5Indexer]) -> None:
        super().__init__(spec)
        self.ix, self.indexers = ix, indexers

    def choose(self, layer: int, index_q: torch.Tensor, index_w: torch.Tensor, keys: torch.Tensor,
               pos: torch.Tensor, kv: int) -> torch.Tensor:
        return pooled_selection(index_q, index_w, keys[:kv], self.indexers[layer].ape, pos, self.ix)


class PooledDecode(PagedSparseMlaDecode):
    """A decode bucket's attention with the pooled selection (the DSA family's decode form,
    graphcp.model.dsa.sparse_decode, with :func:`pooled_selection` over each row's request's
    paged indexer rows): every shape the bucket's, reading no host value. A padding row
    (length 0) selects nothing."""

    name = "paged-pooled-decode"

    def __init__(self, spec: SparseMlaSpec, meta: AttentionMetadata, ix: PooledIndexer,
                 indexers: dict[int, Glm5Indexer]) -> None:
        super().__init__(spec, meta)
        self.ix, self.indexers = ix, indexers

    def _topk(self, layer: int, index_q: torch.Tensor, index_w: torch.Tensor, cache: MlaStorage,
              table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        B, W = table.shape
        rows = cache.index_keys(layer).index_select(0, table.reshape(-1)).view(B, W * cache.page_size, -1)
        return pooled_selection(index_q, index_w, rows, self.indexers[layer].ape, lens - 1, self.ix)
