"""Paged decode attention over static device metadata, in plain torch operations: the
reference decode kernel (the ``torch`` attention backend's, and a family's own backend's).

One query row a segment (a decode step's request), over ``kv_lens[s]`` keys in the pages
``page_table[s]`` of one layer's cache, with its natural-log LSE (the contract of
graphcp.attention.base.DecodeKernel; a row with no key: output 0, LSE -inf). It reads only
device tensors whose shapes a decode bucket fixes (the page table ``[B, W]``, the lengths
``[B]``) and never the host, so a graph captures it on any device. The keys are read a
block of pages at a time (as many as 64 MiB of K allow) and the blocks merged by their
LSE (split-KV, as flash-decoding does), so its memory is bounded by a block, not by the
table's width; but its work is the
table's width for every row, whatever the lengths: plain torch operations cannot skip a
row's pages past its length without reading the lengths on the host. The kernels
registered for the GPU backends read only each row's own pages (docs/decode.md). An eager
decode step runs it over the step's own page table (as wide as its longest request).
"""

from __future__ import annotations

import torch

from graphcp.attention.base import AttentionMetadata, DecodeKernel
from graphcp.attention.catalog import register_decode_backend
from graphcp.attention.ring.merge import merge_states
from graphcp.kv.layout import kv_cache_views

#: keys x KV heads x head_dim of every request read at once (bounds a block's gathered K
#: or V to this many values: 64 MiB in float32), and the fewest pages a block takes
BLOCK_VALUES, MIN_BLOCK_PAGES = 1 << 24, 1


def block_pages(rows: int, page_size: int, kv_heads: int, head_dim: int) -> int:
    """Pages of every row a block reads: as many as :data:`BLOCK_VALUES` allow."""
    return max(MIN_BLOCK_PAGES, BLOCK_VALUES // max(1, rows * page_size * kv_heads * head_dim))


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
        qs = q[:B].float().view(B, Hk, g, D) * spec.scale
        acc = acc_lse = None
        step = block_pages(B, ps, Hk, D)
        for p0 in range(0, W, step):
            n = min(step, W - p0)
            idx = table[:, p0 : p0 + n].reshape(-1)
            k = k_pages.index_select(0, idx).view(B, n * ps, Hk, D).float()  # [B, T, Hk, D]
            v = v_pages.index_select(0, idx).view(B, n * ps, Hk, D).float()
            # a KV head's keys are a strided [B, T, D] view BLAS reads as is (no transposed copy)
            s = torch.stack([torch.bmm(qs[:, h], k[:, :, h].transpose(1, 2)) for h in range(Hk)], 1)  # [B, Hk, g, T]
            pos = torch.arange(p0 * ps, (p0 + n) * ps, device=q.device)
            s.masked_fill_(pos.view(1, 1, 1, -1) >= lens.view(B, 1, 1, 1), float("-inf"))
            top = s.amax(-1, keepdim=True)
            top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # no key in the block: subtract 0
            p = s.sub_(top).exp_()
            total = p.sum(-1)  # [B, Hk, g]; 0 where the block holds no key
            seen = total > 0
            o = torch.stack([torch.bmm(p[:, h], v[:, :, h]) for h in range(Hk)], 1)  # [B, Hk, g, D]
            o = o / torch.where(seen, total, torch.ones_like(total)).unsqueeze(-1)
            blse = torch.where(seen, top.squeeze(-1) + torch.log(total), torch.full_like(total, float("-inf")))
            if acc is None:
                acc, acc_lse = o, blse
            else:
                acc, acc_lse = merge_states([acc, o], [acc_lse, blse])
        out[:B] = acc.reshape(B, Hk * g, D).to(out.dtype)
        if lse is not None:
            lse[:B] = acc_lse.reshape(B, Hk * g)
