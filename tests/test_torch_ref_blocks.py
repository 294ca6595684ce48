"""The torch reference attends a bottom-right causal segment (new rows after cached
keys, a zigzag rank's late block) in blocks of query rows: its mask and the fallback's
float32 scores stay within ``TorchAttention.max_block_elements`` however long the
prompt (no ``q_len x kv_len`` temporary: measured with torch's memory profiler), and the
blocks' results are within rounding of one block's (what the reference computed
before) on every path, float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from graphcp.attention.backends.torch_ref import TorchAttention, row_blocks
from graphcp.attention.base import AttentionMetadata, AttentionSpec
from graphcp.attention.reference_cases import tensors

PAGE = 16
SPEC = AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=PAGE, scale=0.25)
#: (q_len, kv_len) segments: bottom-right ones (fewer rows than keys, one row), a causal
#: square, and one whose rows split unevenly into blocks
SEGMENTS = [(37, 200), (1, 50), (64, 64), (130, 131), (23, 500)]
PATHS = ["plain", "lse-fused", "lse-matmul"]


def _meta(segments) -> tuple[AttentionMetadata, int]:
    """Each segment its own request, its pages in order after page 0."""
    width = max(-(-kv // PAGE) for _, kv in segments)
    table, at = np.zeros((len(segments), width), np.int32), 1
    for i, (_, kv) in enumerate(segments):
        n = -(-kv // PAGE)
        table[i, :n] = np.arange(at, at + n)
        at += n
    cu = np.concatenate([[0], np.cumsum([q for q, _ in segments])])
    return AttentionMetadata.from_host(cu, np.array([kv for _, kv in segments]), table, PAGE, causal=True), at


def _attend(segments, dtype, path, monkeypatch, max_elements=None):
    if path == "lse-matmul":
        monkeypatch.setattr(TorchAttention, "_cpu_flash", None)
    meta, pages = _meta(segments)
    q, kv, out, lse = tensors(SPEC, meta.num_q_rows, pages, dtype)
    backend = TorchAttention(SPEC)
    if max_elements is not None:
        backend.max_block_elements = max_elements
    backend.forward(q, kv, meta, out, lse if path != "plain" else None)
    return out, lse


def test_row_blocks_cover_the_rows_within_the_bound():
    assert row_blocks(100, 400, 1 << 20) == [(0, 100)]  # fits: one block, today's call
    assert row_blocks(10, 400, 1000) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert row_blocks(3, 5000, 1000) == [(0, 1), (1, 2), (2, 3)]  # at least one row a block
    for q_len, kv_len, budget in ((1000, 4000, 12345), (7, 7, 1), (4096, 131072, 1 << 22)):
        blocks = row_blocks(q_len, kv_len, budget)
        assert blocks[0][0] == 0 and blocks[-1][1] == q_len
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        assert all((b1 - b0) * kv_len <= max(budget, kv_len) for b0, b1 in blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", PATHS)
def test_blocks_are_within_rounding_of_one_block(dtype, path, monkeypatch):
    """Against one block a segment (what the reference computed before blocks): within 8
    float32 ulps, or one bfloat16 ulp, of the largest output (the kernels' summation
    order changes with the rows of a call), the LSE (float32) within 2e-6 (2e-4 from
    bfloat16 products)."""
    whole_out, whole_lse = _attend(SEGMENTS, dtype, path, monkeypatch, max_elements=1 << 40)
    out, lse = _attend(SEGMENTS, dtype, path, monkeypatch, max_elements=1000)  # 2-20 rows a block
    diff, ref = (out.float() - whole_out.float()).abs().max(), whole_out.float().abs().max()
    assert diff <= (8 if dtype == torch.float32 else 1) * torch.finfo(dtype).eps * ref, float(diff)
    if path != "plain":
        assert (lse - whole_lse).abs().max() <= (2e-6 if dtype == torch.float32 else 2e-4)


@pytest.mark.parametrize("path", PATHS)
def test_a_long_segment_allocates_no_rows_by_keys_temporary(path, monkeypatch):
    """2048 new rows after 6144 cached keys: no allocation as large as a bool mask of
    2048 x 8192 (the smallest q x kv tensor: 16 MiB), the largest within the block bound."""
    q_len, kv_len = 2048, 8192
    budget = 1 << 18
    monkeypatch.setattr(TorchAttention, "max_block_elements", budget)
    meta, pages = _meta([(q_len, kv_len)])
    dtype = torch.float32
    q, kv, out, lse = tensors(SPEC, q_len, pages, dtype)
    if path == "lse-matmul":
        monkeypatch.setattr(TorchAttention, "_cpu_flash", None)
    backend = TorchAttention(SPEC)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        backend.forward(q, kv, meta, out, None if path == "plain" else lse)
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    assert largest < q_len * kv_len, largest
    # a block's float32 mask or scores, or one request's K / V with the query heads
    assert largest <= max(4 * budget, 4 * kv_len * SPEC.num_q_heads * SPEC.head_dim), largest
