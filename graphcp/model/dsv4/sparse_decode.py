"""A DeepSeek V4 layer's attention in a decode graph: every shape its bucket's.

A decode step is one query row a request, the same rows on every rank. The reference
(:class:`~graphcp.model.dsv4.sparse.TorchDsV4Attention`) plans the batch on the host
and so runs eagerly; a decode graph captures this form instead, over the bucket's static
metadata (``[B, W]`` page table, ``[B]`` lengths after the step: graphcp.runtime.capture.
phases' ``DecodeGraphs``), reading no host value. The same steps, for each row at
position ``p`` (its length ``p + 1``):

1. **pool** (compressed layers): a compressor accumulates its block over the steps (the
   source rows the step wrote) and emits an entry when the block completes: the row's
   entry ``e = (p + 1) / m - 1`` is pooled from its source rows
   (:func:`~graphcp.model.dsv4.sparse.pool`, CSA's overlap and entry 0 included) and
   written to its slot when ``(p + 1) % m == 0``, else to the scratch page;
2. **select** (CSA): the row's indexer scores over its entries so far (a block of
   :data:`BLOCK_ENTRIES` at a time), the top ``index_topk`` past ``index_topk`` of them
   (every one before);
3. **attend**: the window's ``sliding_window`` rows up to ``p`` and the row's entries
   (HCA: all; CSA: the ``index_topk`` selected, gathered: a CSA step reads ``window +
   index_topk`` keys whatever the context), one sink a head
   (:func:`~graphcp.model.dsv4.sparse.attend_keys`). A padding row (length 0) sees
   nothing and gets zeros.

Its work is the bucket's page width, whatever the lengths.
"""

from __future__ import annotations

import numpy as np
import torch

from graphcp.attention.base import Attention, AttentionMetadata, BatchRequests
from graphcp.kv.page_table import SCRATCH_PAGE
from graphcp.model.dsv4.cache import CSA, SLIDING, DsV4Storage
from graphcp.model.dsv4.sparse import PoolWeights, TorchDsV4Attention, attend_keys, index_scores, pool, rope_at

#: entries of every request scored at once (bounds the indexer's [B, H_I, entries] float32 scores)
BLOCK_ENTRIES = 4096


class PagedDsV4Decode(Attention):
    """V4's attention of a decode bucket (see the module doc), bound to its static ``meta``."""

    name = "paged-v4-decode"
    supports_full_graph = True

    def __init__(self, reference: TorchDsV4Attention, meta: AttentionMetadata) -> None:
        self.spec, self.cos, self.sin = reference.spec, reference.cos, reference.sin
        self.meta = meta

    def prepare(self, meta: AttentionMetadata, requests: BatchRequests | None = None) -> None:
        """Nothing: everything it reads is the bucket's static metadata."""

    def forward_stats(self, prefix_lens: np.ndarray, extend_lens: np.ndarray) -> dict[str, int]:
        return {}

    def forward(self, layer: int, q: torch.Tensor, index_q: torch.Tensor | None, index_w: torch.Tensor | None,
                sinks: torch.Tensor, cache: DsV4Storage, weights: PoolWeights | None, out: torch.Tensor) -> None:
        sp, cs = self.spec, self.spec.cache
        table, lens = self.meta.page_table.long(), self.meta.kv_lens.long()
        B, W = table.shape
        kind, m = cs.layer_kinds[layer], cs.compress_rate(layer)
        if kind != SLIDING:
            self._pool(layer, cache, weights, table, lens)
        win = sp.sliding_window
        key_pos = lens.unsqueeze(1) - win + torch.arange(win, device=lens.device).unsqueeze(0)  # (p - win, p]
        visible = key_pos >= 0
        slots = cache.token_slots(table, key_pos.clamp(min=0)).reshape(-1)
        keys = cache.window(layer).flatten(0, 1).index_select(0, slots).view(B, win, -1)
        entries = W * cache.page_size // m if m else 0  # the most a request of the bucket holds
        if entries:
            counts = lens // m  # the entries each row sees
            e = torch.arange(entries, device=lens.device).unsqueeze(0).expand(B, -1)
            if kind == CSA and entries > sp.index_topk:  # attend the selected entries only
                e = self._select(layer, index_q[:B], index_w[:B], cache, table, e, counts)
            slots = cache.entry_slots(layer, table, e).reshape(-1)
            picked = cache.entries(layer).flatten(0, 1).index_select(0, slots).view(B, -1, keys.shape[2])
            keys = torch.cat([keys, picked], dim=1)
            visible = torch.cat([visible, e < counts.unsqueeze(1)], dim=1)
        out[:B] = attend_keys(q[:B], keys, visible, sinks, sp.head_dim ** -0.5).to(out.dtype)

    def _select(self, layer: int, iq: torch.Tensor, iw: torch.Tensor, cache: DsV4Storage, table: torch.Tensor,
                e: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``[B, index_topk]``: the entries each row attends: the indexer's top
        ``index_topk`` of those it sees where it sees more, else its first ``index_topk``
        (all it sees, and some it does not: masked). The scores in blocks of
        :data:`BLOCK_ENTRIES` entries (each row's index entries gathered a block at a time)."""
        topk, B, E = self.spec.index_topk, e.shape[0], e.shape[1]
        index_entries = cache.index_entries(layer).flatten(0, 1)
        scores = []
        for e0 in range(0, E, BLOCK_ENTRIES):
            block = e[:, e0: e0 + BLOCK_ENTRIES]
            ik = index_entries.index_select(0, cache.entry_slots(layer, table, block).reshape(-1))
            scores.append(index_scores(iq, iw, ik.view(B, block.shape[1], -1), self.spec.cache.index_head_dim ** -0.5))
        scores = torch.cat(scores, dim=1).masked_fill(e >= counts.unsqueeze(1), float("-inf"))
        return torch.where((counts > topk).unsqueeze(1), scores.topk(topk, dim=-1).indices, e[:, :topk])

    def _pool(self, layer: int, cache: DsV4Storage, w: PoolWeights, table: torch.Tensor, lens: torch.Tensor) -> None:
        """Each row's entry that its token completes, pooled and written (the others to scratch)."""
        cs, ps = self.spec.cache, cache.page_size
        kind, m = cs.layer_kinds[layer], cs.compress_rate(layer)
        overlap, hd = kind == CSA, cs.head_dim
        tokens = table.shape[1] * ps  # the bucket's
        e = (lens // m - 1).clamp(min=0)
        closes = (lens > 0) & (lens % m == 0)
        span = 2 * m if overlap else m
        start = (e - 1) * m if overlap else e * m
        # (a padding row's positions may pass the bucket's pages: read anywhere, written to scratch)
        src_pos = (start.unsqueeze(1) + torch.arange(span, device=lens.device).unsqueeze(0)).clamp(0, tokens - 1)
        src = cache.sources(layer).flatten(0, 1).index_select(0, cache.token_slots(table, src_pos).reshape(-1))
        src = src.view(lens.shape[0], span, cs.raw_width(layer))
        width = 4 * hd if overlap else 2 * hd
        first = (e == 0) if overlap else None
        slot = cache.entry_slots(layer, table, e.clamp(max=max(tokens // m - 1, 0)).unsqueeze(1))[:, 0]
        dest = torch.where(closes, slot, torch.full_like(e, SCRATCH_PAGE * cache.epp[kind]))
        positions = e * m
        entries = pool(src[..., :width], w.bias, w.norm, self.spec.norm_eps, hd, overlap, first)
        cache.entries(layer).flatten(0, 1).index_copy_(0, dest, rope_at(entries, self.cos, self.sin, positions))
        if overlap:
            idx = pool(src[..., width:], w.index_bias, w.index_norm, self.spec.norm_eps, cs.index_head_dim, True, first)
            cache.index_entries(layer).flatten(0, 1).index_copy_(0, dest, rope_at(idx, self.cos, self.sin, positions))

