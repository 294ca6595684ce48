"""Reference attention backend in plain torch, for any device.

Loops over segments on the host (it reads the host copy of the metadata), so it
runs eagerly: in graph mode it is a break. Scores are computed in float32.

With an LSE out (ring steps) on a CPU it calls ATen's CPU flash-attention kernel,
which returns the float32 log-sum-exp with the output (fused, as fast as the
plain path); elsewhere, or where that op is missing, float32 matmuls, a
log-sum-exp and a second matmul per block of rows (the readable fallback, and
what the tests compare the fused path with).

A bottom-right causal segment (new rows after cached keys, or a zigzag rank's late
block) would need a mask, which the kernels take as a tensor of rows x keys. On a CPU
it runs as two unmasked calls of the flash kernel, the keys before the segment's rows
and the segment's own square (causal), merged by their LSEs; elsewhere (and in the
matmul fallback) in blocks of query rows (:func:`row_blocks`), each over the keys its
rows can see, so one call's mask (or float32 scores) stays within
``TorchAttention.max_block_elements`` however long the prompt. Either is within
rounding of one masked call.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from graphcp.attention.base import AttentionBackend, AttentionMetadata, BatchRequests
from graphcp.attention.catalog import register_backend
from graphcp.attention.staging import to_device_packed
from graphcp.kv.layout import kv_cache_views


def gather_segment_kv(
    k_pages: torch.Tensor, v_pages: torch.Tensor, pages: "list[int] | torch.Tensor", kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous [kv_len, H, D] K and V of one request from its pages."""
    idx = torch.as_tensor(pages, device=k_pages.device, dtype=torch.long)
    k = k_pages.index_select(0, idx).flatten(0, 1)[:kv_len]
    v = v_pages.index_select(0, idx).flatten(0, 1)[:kv_len]
    return k, v


def bottom_right_causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool, True where row i may see key j: j < kv_len - q_len + i + 1."""
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    cols = torch.arange(kv_len, device=device).unsqueeze(0)
    return cols <= rows + (kv_len - q_len)


def row_blocks(q_len: int, kv_len: int, max_elements: int) -> list[tuple[int, int]]:
    """``[b0, b1)`` blocks of a bottom-right causal segment's ``q_len`` rows whose
    ``rows x keys`` (block ``[b0, b1)`` sees keys ``[0, kv_len - q_len + b1)``) stay
    within ``max_elements`` (at least one row a block): the whole segment when it fits."""
    rows = max(1, max_elements // max(kv_len, 1))
    return [(b0, min(q_len, b0 + rows)) for b0 in range(0, q_len, rows)]


def coalesced_segments(meta: AttentionMetadata) -> list[tuple[int, int, int, np.ndarray]]:
    """The non-empty segments as ``(q0, q1, kv_len, pages)``, with back-to-back segments
    of one request merged: segment s+1 continues segment s when its first row sits at
    position ``kv_len[s]`` (``kv_len[s+1] - q_len[s+1] == kv_len[s]``) of the same
    request (its pages start with s's pages; requests never share pages). Bottom-right
    causal attention of the merged rows is exactly that of the two parts, so this
    changes no result. It matters at CP = 1, where zigzag splits every request into an
    early and a late block on the one rank: one causal segment of the whole request
    instead of a causal half plus a masked one (~25% less attention work, no mask)."""
    cu, kv_lens, table = meta.cu_seqlens_q_host, meta.kv_lens_host, meta.page_table_host
    merge = meta.causal  # unmasked segments of one request do not concatenate
    runs: list[list] = []
    for s in range(meta.num_segments):
        q0, q1, kv_len = int(cu[s]), int(cu[s + 1]), int(kv_lens[s])
        if q1 == q0:
            continue
        n_pages = -(-kv_len // meta.page_size)
        if runs and merge:
            r = runs[-1]
            prev_pages = -(-r[2] // meta.page_size)
            if (r[1] == q0 and kv_len - (q1 - q0) == r[2] and n_pages >= prev_pages
                    and np.array_equal(table[s, :prev_pages], r[3][:prev_pages])):
                r[1], r[2], r[3] = q1, kv_len, table[s, :n_pages]
                continue
        runs.append([q0, q1, kv_len, table[s, :n_pages]])
    return [tuple(r) for r in runs]


@register_backend("torch", kv_layout="NHD", per_request=False)
class TorchAttention(AttentionBackend):
    supports_full_graph = False

    #: query rows per score block when LSE is asked (bounds the float32 score memory)
    lse_block_rows = 1024
    #: the most (query row x key) elements one call's mask, or the fallback's scores of
    #: all heads, may hold: 16 MiB of a float32 mask (module doc)
    max_block_elements = 1 << 22

    #: (metadata, its segments with their page indices as tensors) of the forward
    #: :meth:`prepare` planned: every layer's call reads them instead of redoing them
    _planned: tuple | None = None

    def prepare(self, meta: AttentionMetadata, requests: BatchRequests | None = None) -> None:
        self._planned = (meta, self._runs(meta))

    @staticmethod
    def _runs(meta: AttentionMetadata) -> list[tuple[int, int, int, torch.Tensor]]:
        """:func:`coalesced_segments` with each page list a long tensor on the metadata's device
        (one upload for all of them)."""
        runs = coalesced_segments(meta)
        pages = to_device_packed([r[3] for r in runs], meta.device) if runs else []
        return [(q0, q1, kv_len, p) for (q0, q1, kv_len, _), p in zip(runs, pages)]

    def forward(self, q, kv_cache, meta: AttentionMetadata, out, lse=None) -> None:
        spec = self.spec
        group = spec.num_q_heads // spec.num_kv_heads
        k_pages, v_pages = kv_cache_views(kv_cache, spec.kv_layout)
        causal = meta.causal
        planned = self._planned
        for q0, q1, kv_len, pages in planned[1] if planned is not None and planned[0] is meta else self._runs(meta):
            if kv_len == 0:  # non-causal rows that see no key (the contract's values)
                out[q0:q1] = 0
                if lse is not None:
                    lse[q0:q1] = float("-inf")
                continue
            k, v = gather_segment_kv(k_pages, v_pages, pages, kv_len)
            qs = q[q0:q1].transpose(0, 1)  # [Hq, q, D]
            ks = k.transpose(0, 1).repeat_interleave(group, dim=0)
            vs = v.transpose(0, 1).repeat_interleave(group, dim=0)
            if lse is None:
                # 4-D inputs: on CPU, 3-D ones take SDPA's math path (materialised float32
                # scores, 3-5x slower and [H, q, kv] memory) instead of the flash kernel.
                # q_len == kv_len: bottom-right = top-left causal, and is_causal lets the
                # kernel skip the masked blocks.
                if not causal:
                    o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], scale=spec.scale)
                elif q1 - q0 == kv_len:
                    o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True,
                                                       scale=spec.scale)
                else:
                    self._bottom_right(qs, ks, vs, q0, q1, kv_len, out)
                    continue
                out[q0:q1] = o[0].transpose(0, 1).to(out.dtype)
            else:
                self._with_lse(qs, ks, vs, q0, q1, kv_len, out, lse, causal)

    def _bottom_right(self, qs, ks, vs, q0, q1, kv_len, out) -> None:
        """A bottom-right causal segment: on a CPU in two unmasked parts
        (:meth:`_bottom_right_split`); elsewhere a block of rows at a time
        (:func:`row_blocks`), each with its mask."""
        if self._fused(qs):
            self._bottom_right_split(qs, ks, vs, q0, q1, kv_len, out, None)
            return
        q_len = q1 - q0
        for b0, b1 in row_blocks(q_len, kv_len, self.max_block_elements):
            seen = kv_len - q_len + b1  # the keys rows [b0, b1) can see
            mask = bottom_right_causal_mask(b1 - b0, seen, qs.device)
            o = F.scaled_dot_product_attention(qs[None, :, b0:b1], ks[None, :, :seen], vs[None, :, :seen],
                                               attn_mask=mask, scale=self.spec.scale)
            out[q0 + b0:q0 + b1] = o[0].transpose(0, 1).to(out.dtype)

    #: ATen's CPU flash attention, which also returns the LSE (None: not in this torch)
    _cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

    def _fused(self, qs) -> bool:
        """Whether ATen's CPU flash kernel (output and LSE) takes these inputs."""
        return self._cpu_flash is not None and qs.device.type == "cpu" and qs.dtype in (torch.float32, torch.bfloat16)

    def _with_lse(self, qs, ks, vs, q0, q1, kv_len, out, lse, causal: bool = True) -> None:
        if self._fused(qs):
            self._with_lse_fused(qs, ks, vs, q0, q1, kv_len, out, lse, causal)
        else:
            self._with_lse_blocks(qs, ks, vs, q0, q1, kv_len, out, lse, causal)

    def _with_lse_fused(self, qs, ks, vs, q0, q1, kv_len, out, lse, causal: bool) -> None:
        if causal and q1 - q0 != kv_len:
            self._bottom_right_split(qs, ks, vs, q0, q1, kv_len, out, lse)
            return
        # no mask: the kernel skips the masked blocks itself
        o, row_lse = self._cpu_flash(qs[None], ks[None], vs[None], 0.0, causal, scale=self.spec.scale)[:2]
        out[q0:q1] = o[0].transpose(0, 1).to(out.dtype)
        lse[q0:q1] = row_lse[0].transpose(0, 1)

    def _bottom_right_split(self, qs, ks, vs, q0, q1, kv_len, out, lse) -> None:
        """A bottom-right causal segment with no mask (ATen's CPU flash kernel): every row
        sees all the keys before the segment's own (none masked), and the segment's own
        keys causally (a square: the kernel skips the masked blocks); the two parts merge
        by their LSEs in float32. Temporaries: O(rows x heads x head_dim)."""
        own = kv_len - (q1 - q0)  # the keys before the segment's rows

        def part(k, v, causal: bool):
            o, row_lse = self._cpu_flash(qs[None], k[None], v[None], 0.0, causal, scale=self.spec.scale)[:2]
            return o[0].float(), row_lse[0]  # [H, rows, D], [H, rows]

        (o1, l1), (o2, l2) = part(ks[:, :own], vs[:, :own], False), part(ks[:, own:], vs[:, own:], True)
        top = torch.maximum(l1, l2)
        w1, w2 = torch.exp(l1 - top), torch.exp(l2 - top)
        total = w1 + w2
        o = o1 * (w1 / total).unsqueeze(-1) + o2 * (w2 / total).unsqueeze(-1)
        out[q0:q1] = o.transpose(0, 1).to(out.dtype)
        if lse is not None:
            lse[q0:q1] = (top + torch.log(total)).transpose(0, 1)

    def _with_lse_blocks(self, qs, ks, vs, q0, q1, kv_len, out, lse, causal: bool = True) -> None:
        q_len = q1 - q0
        kf, vf = ks.float(), vs.float()
        # float32 scores of every head: [heads, rows, keys] within max_block_elements
        step = max(1, min(self.lse_block_rows, self.max_block_elements // max(1, qs.shape[0] * kv_len)))
        for b0 in range(0, q_len, step):
            b1 = min(q_len, b0 + step)
            scores = torch.matmul(qs[:, b0:b1].float(), kf.transpose(1, 2)) * self.spec.scale
            if causal:
                rows = torch.arange(b0, b1, device=qs.device).unsqueeze(1)
                cols = torch.arange(kv_len, device=qs.device).unsqueeze(0)
                scores.masked_fill_(~(cols <= rows + (kv_len - q_len)), float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)  # [H, rows]
            probs = torch.exp(scores - row_lse.unsqueeze(-1))
            o = torch.matmul(probs, vf)
            out[q0 + b0 : q0 + b1] = o.transpose(0, 1).to(out.dtype)
            lse[q0 + b0 : q0 + b1] = row_lse.transpose(0, 1)
