"""The torch reference's bottom-right causal segments (new rows after cached keys, a
zigzag rank's late block) at long prompts: on a CPU two unmasked flash calls merged by
their LSEs, elsewhere blocks of query rows whose mask (or the matmul fallback's float32
scores) stays within ``TorchAttention.max_block_elements``. No path allocates a
``q_len x kv_len`` temporary (measured with torch's memory profiler), and each is within
rounding of what the reference computed before (one call a segment with its whole
mask), float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from graphcp.attention.backends.torch_ref import (
    TorchAttention,
    bottom_right_causal_mask,
    coalesced_segments,
    gather_segment_kv,
    row_blocks,
)
from graphcp.attention.base import AttentionMetadata, AttentionSpec
from graphcp.attention.reference_cases import tensors
from graphcp.kv.layout import kv_cache_views

PAGE = 16
SPEC = AttentionSpec(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=PAGE, scale=0.25)
#: (q_len, kv_len) segments: bottom-right ones (fewer rows than keys, one row), a causal
#: square, and one whose rows split unevenly into blocks
SEGMENTS = [(37, 200), (1, 50), (64, 64), (130, 131), (23, 500)]
#: the CPU flash kernel's split (no mask), and where it is missing (CUDA) the row blocks
#: with a mask: SDPA's, and the matmul fallback's with an LSE
PATHS = ["plain", "lse-fused", "plain-blocks", "lse-matmul"]


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
    if path in ("plain-blocks", "lse-matmul"):
        monkeypatch.setattr(TorchAttention, "_cpu_flash", None)
    meta, pages = _meta(segments)
    q, kv, out, lse = tensors(SPEC, meta.num_q_rows, pages, dtype)
    backend = TorchAttention(SPEC)
    if max_elements is not None:
        backend.max_block_elements = max_elements
    backend.forward(q, kv, meta, out, None if path.startswith("plain") else lse)
    monkeypatch.undo()
    return out, lse


def _one_masked_flash_call(segments, dtype):
    """What the reference computed before, with an LSE on a CPU: one flash call a segment,
    a bottom-right one with its whole additive mask."""
    meta, pages = _meta(segments)
    q, kv, out, lse = tensors(SPEC, meta.num_q_rows, pages, dtype)
    k_pages, v_pages = kv_cache_views(kv, SPEC.kv_layout)
    group = SPEC.num_q_heads // SPEC.num_kv_heads
    for q0, q1, kv_len, pages_ in coalesced_segments(meta):
        k, v = gather_segment_kv(k_pages, v_pages, pages_, kv_len)
        qs = q[q0:q1].transpose(0, 1)
        ks, vs = (t.transpose(0, 1).repeat_interleave(group, dim=0) for t in (k, v))
        keep = bottom_right_causal_mask(q1 - q0, kv_len, q.device)
        mask = torch.zeros(q1 - q0, kv_len, dtype=dtype).masked_fill_(~keep, float("-inf"))
        o, row_lse = TorchAttention._cpu_flash(qs[None], ks[None], vs[None], 0.0, False, attn_mask=mask,
                                               scale=SPEC.scale)[:2]
        out[q0:q1], lse[q0:q1] = o[0].transpose(0, 1), row_lse[0].transpose(0, 1)
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
def test_every_path_is_within_rounding_of_one_masked_call(dtype, path, monkeypatch):
    """Against what the reference computed before (one call a segment with its whole mask):
    within 8 float32 ulps, or 2 bfloat16 ulps, of the largest output (the kernels sum in
    another order, the split's two parts are merged after rounding to the dtype), the LSE
    (float32) within 2e-6 (2e-4 from bfloat16 products)."""
    if path == "lse-fused":
        before_out, before_lse = _one_masked_flash_call(SEGMENTS, dtype)
    else:  # one row block: the masked call the reference made
        before_out, before_lse = _attend(SEGMENTS, dtype, "plain-blocks" if path.startswith("plain") else path,
                                         monkeypatch, max_elements=1 << 40)
    out, lse = _attend(SEGMENTS, dtype, path, monkeypatch, max_elements=1000)  # 2-20 rows a block
    diff, ref = (out.float() - before_out.float()).abs().max(), before_out.float().abs().max()
    assert diff <= (8 if dtype == torch.float32 else 2) * torch.finfo(dtype).eps * ref, float(diff)
    if not path.startswith("plain"):
        assert (lse - before_lse).abs().max() <= (2e-6 if dtype == torch.float32 else 2e-4)


@pytest.mark.parametrize("path", PATHS)
def test_a_long_segment_allocates_no_rows_by_keys_temporary(path, monkeypatch):
    """2048 new rows after 6144 cached keys: no allocation as large as a bool mask of
    2048 x 8192 (the smallest q x kv tensor: 16 MiB); the largest within a block's mask
    or scores, or one request's K / V (the split takes no mask at all)."""
    q_len, kv_len = 2048, 8192
    budget = 1 << 20
    monkeypatch.setattr(TorchAttention, "max_block_elements", budget)
    meta, pages = _meta([(q_len, kv_len)])
    dtype = torch.float32
    q, kv, out, lse = tensors(SPEC, q_len, pages, dtype)
    if path in ("plain-blocks", "lse-matmul"):
        monkeypatch.setattr(TorchAttention, "_cpu_flash", None)
    backend = TorchAttention(SPEC)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        backend.forward(q, kv, meta, out, None if path.startswith("plain") else lse)
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    assert largest < q_len * kv_len, largest
    # a block's float32 mask or scores, or one request's K / V with the query heads
    assert largest <= max(4 * budget, 4 * kv_len * SPEC.num_q_heads * SPEC.head_dim), largest
