"""Hand-built zigzag plans, random inputs and the torch reference for the tests of
the FlashInfer and trtllm backends (``test_gpu_backend_*.py``)."""

from __future__ import annotations

import numpy as np
import torch

from graphcp.attention.base import AttentionMetadata, AttentionSpec
from graphcp.attention.torch_ref import TorchAttention

SENTINEL = -1024.0  # exact in every dtype: padding rows must still hold it
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # max |x - ref| / max |ref| (bf16: output rounding)

# The worked example: C = 2, rank 0, extend [40, 3], prefix [20, 0], page size 16.
# Request 0: blocks [10, 10, 10, 10] -> early q 10 kv 30, late q 10 kv 60 (pages 1-4).
# Request 1: blocks [1, 1, 1, 0]    -> early q 1 kv 1, late q 0 kv 3 (empty; page 5).
EXAMPLE = dict(extend=[40, 3], prefix=[20, 0], cp=2, rank=0, page_size=16)


def zigzag_meta(
    extend: list[int], prefix: list[int], cp: int, rank: int, page_size: int, width: int = 8
) -> AttentionMetadata:
    """Segments (early, late) per request; request j owns pages allocated in order from 1."""
    q_lens, kv_lens, rows = [], [], []
    next_page = 1
    for n, p in zip(extend, prefix):
        base, rem = divmod(n, 2 * cp)
        blocks = [base + (b < rem) for b in range(2 * cp)]
        npages = -(-(p + n) // page_size)
        pages = list(range(next_page, next_page + npages))
        next_page += npages
        for b in (rank, 2 * cp - 1 - rank):
            q_lens.append(blocks[b])
            kv_lens.append(p + sum(blocks[: b + 1]))
            rows.append(pages + [0] * (width - npages))
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    return AttentionMetadata.from_host(cu, np.array(kv_lens), np.array(rows), page_size)


def static_meta(num_segments: int, width: int, page_size: int, capacity: int,
                cu: torch.Tensor, kv: torch.Tensor, table: torch.Tensor) -> AttentionMetadata:
    """Full-graph capture metadata as the graph runner builds it: zero host arrays
    (bounds only, ``max_q_len`` = the bucket's rows) over static device buffers."""
    return AttentionMetadata(
        np.zeros(num_segments + 1, np.int32), np.zeros(num_segments, np.int32),
        np.zeros((num_segments, width), np.int32), page_size, capacity, width * page_size,
        device_tensors=(cu, kv, table),
    )


def spec_for(page_size: int, layout: str = "NHD") -> AttentionSpec:
    return AttentionSpec(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=page_size, scale=0.125, kv_layout=layout)


def num_pages_for(*metas: AttentionMetadata) -> int:
    return max(int(m.page_table_host.max()) for m in metas) + 1


def tensors(spec: AttentionSpec, rows: int, num_pages: int, dtype=torch.bfloat16, seed: int = 0):
    """Random q [rows, Hq, D] and KV cache, ``out``/``lse`` filled with the sentinel."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, spec.num_q_heads, spec.head_dim, generator=g).to(dtype)
    page = (spec.page_size, spec.num_kv_heads, spec.head_dim)
    if spec.kv_layout == "HND":
        page = (spec.num_kv_heads, spec.page_size, spec.head_dim)
    kv = torch.randn(num_pages, 2, *page, generator=g).to(dtype)
    out = torch.full_like(q, SENTINEL)
    lse = torch.full((rows, spec.num_q_heads), SENTINEL)
    return q, kv, out, lse


def reference(spec: AttentionSpec, q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata):
    """float32 torch attention of the live rows (output, base-e LSE)."""
    n = meta.num_q_rows
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.zeros(q.shape[:2], dtype=torch.float32)
    TorchAttention(spec).forward(q.float(), kv.float(), meta, out, lse)
    return out[:n], lse[:n]


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def check_against_reference(spec, q, kv, meta, out, lse, dtype) -> None:
    """Live rows equal the reference; padding rows of ``out`` (and ``lse``) kept the sentinel."""
    n = meta.num_q_rows
    ref_out, ref_lse = reference(spec, q, kv, meta)
    assert rel(out[:n], ref_out) <= TOL[dtype], rel(out[:n], ref_out)
    assert (out[n:].float() == SENTINEL).all(), "padding rows of out were written"
    if lse is not None:
        assert float((lse[:n] - ref_lse).abs().max()) <= 1e-4, "LSE differs from the reference (base e)"
        assert (lse[n:] == SENTINEL).all(), "padding rows of lse were written"
