"""Paged decode attention over static device metadata, in plain torch operations: the
reference decode kernel (the ``torch`` attention backend's, and a family's own backend's).

One query row a segment (a decode step's request), over ``kv_lens[s]`` keys in the pages
``page_table[s]`` of one layer's cache, with its natural-log LSE (the contract of
graphcp.attention.base.DecodeKernel; a row with no key: output 0, LSE -inf). It reads only
device tensors whose shapes a decode bucket fixes (the page table ``[B, W]``, the lengths
``[B]``) and never the host, so a graph captures it on any device. The keys are read a
block of pages at a time and the blocks merged by their LSE (split-KV, as flash-decoding
does), so its memory is bounded by a block, not by the table's width; but its work is the
table's width for every row, whatever the lengths: plain torch operations cannot skip a
row's pages past its length without reading the lengths on the host. The kernels
registered for the GPU backends read only each row's own pages (docs/decode.md).
"""

from __future__ import annotations

import torch

from graphcp.attention.base import AttentionMetadata, DecodeKernel
from graphcp.attention.catalog import register_decode_backend
from graphcp.attention.ring.merge import merge_states
from graphcp.kv.layout import kv_cache_views

#: pages of every request read at once (bounds the gathered keys to B x this x page_size)
BLOCK_PAGES = 64


@register_decode_backend("torch")
class PagedDecodeAttention(DecodeKernel):
    """One query row a segment over static metadata (see the module doc)."""

    name = "paged-decode"

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor,
                lse: torch.Tensor | None = None) -> None:
        spec = self.spec
        table, lens = meta.page_table.long(), meta.kv_lens.long()
        B, W = table.shape
        Hk, D = spec.num_kv_heads, spec.head_dim
        g = spec.num_q_heads // Hk
        k_pages, v_pages = kv_cache_views(kv_cache, spec.kv_layout)  # [pages, ps, Hk, D]
        ps = k_pages.shape[1]
        qf = q[:B].float().view(B, Hk, g, D)
        acc = acc_lse = None
        for p0 in range(0, W, BLOCK_PAGES):
            n = min(BLOCK_PAGES, W - p0)
            idx = table[:, p0 : p0 + n].reshape(-1)
            k = k_pages.index_select(0, idx).view(B, n * ps, Hk, D).float()
            v = v_pages.index_select(0, idx).view(B, n * ps, Hk, D).float()
            s = torch.einsum("bhgd,bthd->bhgt", qf, k) * spec.scale
            pos = torch.arange(p0 * ps, (p0 + n) * ps, device=q.device)
            s = s.masked_fill(pos.view(1, 1, 1, -1) >= lens.view(B, 1, 1, 1), float("-inf"))
            blse = torch.logsumexp(s, dim=-1)  # [B, Hk, g]; -inf where the block holds no key
            shift = torch.where(torch.isneginf(blse), torch.zeros_like(blse), blse)
            o = torch.einsum("bhgt,bthd->bhgd", torch.exp(s - shift.unsqueeze(-1)), v)
            if acc is None:
                acc, acc_lse = o, blse
            else:
                acc, acc_lse = merge_states([acc, o], [acc_lse, blse])
        out[:B] = acc.reshape(B, Hk * g, D).to(out.dtype)
        if lse is not None:
            lse[:B] = acc_lse.reshape(B, Hk * g)
