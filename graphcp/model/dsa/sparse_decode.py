"""A DSA model's sparse attention in a decode graph: every shape its bucket's.

A decode step is one query row a request, the same rows on every rank. The reference
(:class:`~graphcp.model.dsa.sparse.TorchSparseMla`) plans each forward's rows on the host
and so runs eagerly; a decode graph captures this form instead, over the bucket's static
metadata (``[B, W]`` page table, ``[B]`` lengths: graphcp.runtime.capture.phases'
``DecodeGraphs``), reading no host value. The same rule, step by step:

1. in a layer that runs the indexer, each row's scores against every cached indexer key
   of its request (:func:`~graphcp.model.dsa.topk.index_scores`, ``W`` pages in blocks of
   :data:`BLOCK_PAGES`, keys past the row's length at -inf) and its top ``index_topk``
   (:func:`~graphcp.model.dsa.topk.select_topk`, ties to the earliest: a row that sees at
   most ``index_topk`` keys selects every one, as the reference's unscored rows do); a
   GLM 'shared' layer reads the selection the last indexer layer left;
2. attention over the selected tokens in MLA's weight-absorbed form (FlashMLA's decode):
   ``q_lat[h] = q_nope[h] W_UK[h]``, scores ``q_lat . latent + q_rope . rope_key`` over the
   gathered ``[latent | rope key]`` rows of the selection, ``out[h] = (p latent) W_UV[h]^T``,
   in float32. A padding row (length 0) selects nothing and gets zeros.
"""

from __future__ import annotations

import numpy as np
import torch

from graphcp.attention.base import AttentionMetadata, BatchRequests
from graphcp.model.dsa.cache import MlaStorage
from graphcp.model.dsa.sparse import SparseMlaBackend, SparseMlaSpec
from graphcp.model.dsa.topk import index_scores, select_topk

#: pages of every request scored at once (bounds the indexer's [B, H_I, keys] float32 scores)
BLOCK_PAGES = 64


class PagedSparseMlaDecode(SparseMlaBackend):
    """The sparse attention of a decode bucket (see the module doc), bound to its static
    ``meta``; its selection buffer is the bucket's too (made here, outside any capture)."""

    name = "paged-sparse-decode"
    supports_full_graph = True

    def __init__(self, spec: SparseMlaSpec, meta: AttentionMetadata) -> None:
        super().__init__(spec)
        self.meta = meta
        rows = meta.num_segments
        self._selected = torch.full((rows, spec.index_topk), -1, dtype=torch.long, device=meta.device)

    def prepare(self, meta: AttentionMetadata, requests: BatchRequests | None = None) -> None:
        """Nothing: everything it reads is the bucket's static metadata."""

    def forward_stats(self, prefix_lens: np.ndarray, extend_lens: np.ndarray) -> dict[str, int]:
        return {}

    def selection_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        return self._selected

    def forward(self, layer, q, index_q, index_w, kv_b_weight, cache: MlaStorage, out) -> None:
        table, lens = self.meta.page_table.long(), self.meta.kv_lens.long()
        B = table.shape[0]
        if index_q is not None:
            self._selected.copy_(self._topk(layer, index_q[:B], index_w[:B], cache, table, lens))
        self.attend_selected(layer, q, kv_b_weight, cache, self._selected, out)

    def attend_selected(self, layer: int, q: torch.Tensor, kv_b_weight: torch.Tensor, cache: MlaStorage,
                        sel: torch.Tensor, out: torch.Tensor) -> None:
        """Step 2 (module doc): each row's attention over its selection ``sel`` ``[B, k]``
        (positions in its request, -1 where it selects fewer)."""
        sp = self.spec
        table = self.meta.page_table.long()
        B = table.shape[0]
        ps = cache.page_size
        page = table.gather(1, sel.clamp(min=0) // ps)
        slots = page * ps + sel.clamp(min=0) % ps  # [B, k]
        lat = cache.latent(layer).flatten(0, 1).index_select(0, slots.reshape(-1)).view(B, -1, cache.latent_dim)
        lat = lat.float()
        w = kv_b_weight.float().view(sp.num_heads, sp.qk_nope_head_dim + sp.v_head_dim, sp.kv_lora_rank)
        w_uk, w_uv = w[:, : sp.qk_nope_head_dim], w[:, sp.qk_nope_head_dim:]
        qf = q[:B].float()
        q_lat = torch.einsum("bhn,hnl->bhl", qf[..., : sp.qk_nope_head_dim], w_uk)
        latent, rope = lat[..., : sp.kv_lora_rank], lat[..., sp.kv_lora_rank:]
        s = (torch.einsum("bhl,bkl->bhk", q_lat, latent)
             + torch.einsum("bhr,bkr->bhk", qf[..., sp.qk_nope_head_dim:], rope)) * sp.softmax_scale
        s = s.masked_fill((sel < 0).unsqueeze(1), float("-inf"))
        top = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isneginf(top), torch.zeros_like(top), top))
        denom = p.sum(dim=-1, keepdim=True)
        o_lat = torch.einsum("bhk,bkl->bhl", p / torch.where(denom > 0, denom, torch.ones_like(denom)), latent)
        out[:B] = torch.einsum("bhl,hvl->bhv", o_lat, w_uv).to(out.dtype)

    def _topk(self, layer: int, index_q: torch.Tensor, index_w: torch.Tensor, cache: MlaStorage,
              table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """``[B, index_topk]``: each row's selection over its request's indexer keys."""
        sp = self.spec
        B, W = table.shape
        ps = cache.page_size
        keys = cache.index_keys(layer)
        scores = []
        for p0 in range(0, W, BLOCK_PAGES):
            n = min(BLOCK_PAGES, W - p0)
            ik = keys.index_select(0, table[:, p0: p0 + n].reshape(-1)).view(B, n * ps, -1)
            scores.append(index_scores(index_q, index_w, ik, sp.index_head_dim ** -0.5))
        scores = torch.cat(scores, dim=1)  # [B, W * ps]
        visible = torch.arange(W * ps, device=scores.device).unsqueeze(0) < lens.unsqueeze(1)
        sel = select_topk(scores.masked_fill(~visible, float("-inf")), sp.index_topk)
        if sel.shape[1] < sp.index_topk:  # a bucket narrower than index_topk: -1 padded
            sel = torch.nn.functional.pad(sel, (0, sp.index_topk - sel.shape[1]), value=-1)
        return sel
