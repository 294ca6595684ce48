"""Every backend runs a ring step: non-causal metadata (every row of a segment sees all
its keys; fewer keys than rows; rows that see no key get output 0 and LSE -inf),
with an LSE out, against a brute-force float32 reference. FlashInfer and trtllm
run through the fakes that model the real kernels (``fake_flashinfer.py``), with
the arguments the real signatures take (``causal=False``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from backend_cases import spec_for
from fake_flashinfer import SM_COUNT, Recorder, fake_flashinfer

from graphcp.attention.backends.flashinfer import FlashInferAttention
from graphcp.attention.backends.torch_ref import TorchAttention
from graphcp.attention.backends.trtllm import TrtllmAttention
from graphcp.attention.base import AttentionMetadata
from graphcp.attention.reference_cases import SENTINEL, tensors
from graphcp.kv.layout import kv_cache_views

PAGE = 16
# segments: (q_len, kv_len, pages): more rows than keys, no keys at all, an empty segment,
# a long key run over three pages
SEGMENTS = [(5, 3, [2]), (4, 0, [0]), (0, 0, [0]), (7, 40, [3, 1, 4]), (2, 17, [5, 6])]


def _meta() -> AttentionMetadata:
    q = [s[0] for s in SEGMENTS]
    table = np.zeros((len(SEGMENTS), 3), np.int32)
    for i, (_, _, pages) in enumerate(SEGMENTS):
        table[i, : len(pages)] = pages
    cu = np.concatenate([[0], np.cumsum(q)])
    return AttentionMetadata.from_host(cu, np.array([s[1] for s in SEGMENTS]), table, PAGE, causal=False)


def _brute(spec, q, kv, meta):
    """float32: every row of a segment over all its keys; output 0 / LSE -inf without keys."""
    k_pages, v_pages = kv_cache_views(kv.float(), spec.kv_layout)
    group = spec.num_q_heads // spec.num_kv_heads
    n = meta.num_q_rows
    out = torch.zeros(n, spec.num_q_heads, spec.head_dim)
    lse = torch.full((n, spec.num_q_heads), float("-inf"))
    cu = meta.cu_seqlens_q_host
    for s in range(meta.num_segments):
        a, b, kv_len = int(cu[s]), int(cu[s + 1]), int(meta.kv_lens_host[s])
        if b == a or kv_len == 0:
            continue
        pages = meta.page_table_host[s]
        k = k_pages[torch.as_tensor(pages, dtype=torch.long)].flatten(0, 1)[:kv_len].repeat_interleave(group, 1)
        v = v_pages[torch.as_tensor(pages, dtype=torch.long)].flatten(0, 1)[:kv_len].repeat_interleave(group, 1)
        scores = torch.einsum("nhd,khd->nhk", q[a:b].float(), k) * spec.scale
        lse[a:b] = torch.logsumexp(scores, -1)
        out[a:b] = torch.einsum("nhk,khd->nhd", torch.softmax(scores, -1), v)
    return out, lse


def _check(spec, q, kv, meta, out, lse, dtype):
    n = meta.num_q_rows
    want_out, want_lse = _brute(spec, q, kv, meta)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[:n].float(), want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse[:n], want_lse, rtol=1e-4, atol=1e-4)  # -inf where no key, equal
    assert (out[n:].float() == SENTINEL).all() and (lse[n:] == SENTINEL).all(), "padding rows were written"
    no_key = meta.no_key_rows()
    assert no_key.tolist() == [5, 6, 7, 8] and torch.isneginf(lse[no_key]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash", "matmul"])
def test_torch_reference_runs_non_causal_steps(dtype, fused, monkeypatch):
    if not fused:
        monkeypatch.setattr(TorchAttention, "_cpu_flash", None)
    spec, meta = spec_for(PAGE), _meta()
    q, kv, out, lse = tensors(spec, 24, 8, dtype)
    TorchAttention(spec).forward(q, kv, meta, out, lse)
    _check(spec, q, kv, meta, out, lse, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_runs_non_causal_steps(dtype):
    pytest.importorskip("triton")
    from graphcp.attention.backends.triton import TritonAttention, interpreting

    if not interpreting():
        pytest.skip("the CPU run needs TRITON_INTERPRET=1")
    spec, meta = spec_for(PAGE), _meta()
    q, kv, out, lse = tensors(spec, 24, 8, dtype)
    TritonAttention(spec, block_m=16, block_n=16).forward(q, kv, meta, out, lse)
    _check(spec, q, kv, meta, out, lse, dtype)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_flashinfer_plans_non_causal_and_writes_rows_without_keys(layout):
    rec = Recorder()
    spec, meta = spec_for(PAGE, layout), _meta()
    shared = torch.empty(1 << 20, dtype=torch.uint8)
    fi = FlashInferAttention(spec, "cpu", max_segments=6, max_pages=12, max_q_rows=24, dtype=torch.bfloat16,
                             flashinfer=fake_flashinfer(rec), workspace=shared)
    assert fi.workspace is shared  # ring steps share one float workspace
    q, kv, out, lse = tensors(spec, 24, 8, torch.bfloat16)
    fi.prepare(meta)
    (plan_args, plan_kw) = rec.named("plan")[-1]
    assert plan_kw["causal"] is False
    # the segment without keys gets the inert scratch key (one page, last_page_len 1)
    qo, kv_indptr, indices, last = plan_args[:4]
    assert indices[kv_indptr[1] : kv_indptr[2]] == [0] and last[1] == 1
    fi.forward(q, kv, meta, out, lse)
    _check(spec, q, kv, meta, out, lse, torch.bfloat16)


def test_trtllm_passes_causal_false_and_writes_rows_without_keys():
    rec = Recorder()
    spec, meta = spec_for(PAGE, "HND"), _meta()
    trt = TrtllmAttention(spec, "cpu", max_segments=6, max_pages_per_segment=8, max_q_rows=24,
                          capability=lambda: (10, 0), sm_count=SM_COUNT, flashinfer=fake_flashinfer(rec))
    q, kv, out, lse = tensors(spec, 24, 8, torch.bfloat16)
    trt.prepare(meta)
    trt.forward(q, kv, meta, out, lse)
    (_, kw), = rec.named("trtllm")
    assert kw["causal"] is False and kw["seq_lens"][1] == 1  # the inert scratch key
    _check(spec, q, kv, meta, out, lse, torch.bfloat16)


def test_non_causal_metadata_is_live_only_and_validated():
    with pytest.raises(ValueError, match="never static"):
        AttentionMetadata(np.zeros(2, np.int32), np.zeros(1, np.int32), np.zeros((1, 1), np.int32), PAGE, 1, 1,
                          device_tensors=(torch.zeros(2), torch.zeros(1), torch.zeros(1, 1)), causal=False)
    with pytest.raises(ValueError, match="causal segment needs q_len <= kv_len"):
        AttentionMetadata.from_host(np.array([0, 5]), np.array([3]), np.zeros((1, 1)), PAGE)
    assert "non-causal" in repr(_meta())
