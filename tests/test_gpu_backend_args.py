"""The argument contract of the FlashInfer and trtllm backends, against recording
fakes of flashinfer (no GPU, no flashinfer install; real kernels are never called).

Plans are zigzag segment lists built by hand: for every request the rank's
early block r and late block 2C-1-r, with ``kv_len = prefix + tokens up to the
end of the block``.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from graphcp.attention import registry
from graphcp.attention.base import AttentionMetadata, AttentionSpec
from graphcp.attention.flashinfer_backend import FlashInferAttention
from graphcp.attention.trtllm_backend import TrtllmAttention

LN2 = math.log(2.0)
SENTINEL = -1024.0
BASE2_LSE = 3.0  # what the fakes write as the kernel's (base-2) LSE
BLACKWELL = lambda: (10, 0)  # noqa: E731


# ---- fakes ------------------------------------------------------------------------
def _plain(x):
    return x.tolist() if isinstance(x, torch.Tensor) else x


@dataclass
class Recorder:
    calls: list[tuple[str, tuple, dict]] = field(default_factory=list)

    def named(self, name: str) -> list[tuple[tuple, dict]]:
        return [(a, k) for n, a, k in self.calls if n == name]


def fake_flashinfer(rec: Recorder) -> types.ModuleType:
    class Wrapper:
        def __init__(self, *args, **kwargs):
            rec.calls.append(("init", args, kwargs))

        def plan(self, *args, **kwargs):
            rec.calls.append(("plan", tuple(_plain(a) for a in args), {k: _plain(v) for k, v in kwargs.items()}))

        def run(self, q, kv_cache, *, out=None, lse=None, return_lse=False):
            rec.calls.append(("run", (q, kv_cache), dict(out=out, lse=lse, return_lse=return_lse)))
            out.fill_(1.0)
            if lse is not None:
                lse.fill_(BASE2_LSE)
            return (out, lse) if return_lse else out

    def trtllm_batch_context_with_kv_cache(
        query, kv_cache, workspace_buffer, block_tables, seq_lens, max_q_len, max_kv_len,
        bmm1_scale, bmm2_scale, batch_size, cum_seq_lens_q, cum_seq_lens_kv, window_left=-1,
        out=None, out_dtype=None, o_sf_scale=None, o_sf_vec_size=None, kv_layout="HND",
        enable_pdl=None, sinks=None, lse=None, return_lse=False,
    ):
        kw = dict(
            query=query, kv_cache=kv_cache, workspace_buffer=workspace_buffer,
            block_tables=block_tables.tolist(), seq_lens=seq_lens.tolist(), max_q_len=max_q_len,
            max_kv_len=max_kv_len, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, batch_size=batch_size,
            cum_seq_lens_q=cum_seq_lens_q.tolist(), cum_seq_lens_kv=cum_seq_lens_kv.tolist(),
            window_left=window_left, out=out, kv_layout=kv_layout, lse=lse, return_lse=return_lse,
        )
        rec.calls.append(("trtllm", (), kw))
        rows = int(cum_seq_lens_q[-1])  # the kernel writes the rows of its sequences only
        out[:rows] = 1.0
        if lse is not None:
            lse[:rows] = BASE2_LSE
        return (out, lse) if return_lse else out

    fi = types.ModuleType("flashinfer")
    fi.BatchPrefillWithPagedKVCacheWrapper = Wrapper
    fi.prefill = types.ModuleType("flashinfer.prefill")
    fi.prefill.trtllm_batch_context_with_kv_cache = trtllm_batch_context_with_kv_cache
    return fi


# ---- plans ------------------------------------------------------------------------
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


def spec_for(page_size: int, layout: str = "NHD") -> AttentionSpec:
    return AttentionSpec(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=page_size, scale=0.125, kv_layout=layout)


def tensors(spec: AttentionSpec, rows: int, num_pages: int = 16, dtype=torch.bfloat16):
    q = torch.zeros(rows, spec.num_q_heads, spec.head_dim, dtype=dtype)
    page = (spec.page_size, spec.num_kv_heads, spec.head_dim)
    if spec.kv_layout == "HND":
        page = (spec.num_kv_heads, spec.page_size, spec.head_dim)
    kv = torch.zeros(num_pages, 2, *page, dtype=dtype)
    out = torch.full_like(q, SENTINEL)
    lse = torch.full((rows, spec.num_q_heads), SENTINEL)
    return q, kv, out, lse


# The worked example: C = 2, rank 0, extend [40, 3], prefix [20, 0], page size 16.
# Request 0: blocks [10, 10, 10, 10] -> early q 10 kv 30, late q 10 kv 60 (pages 1-4).
# Request 1: blocks [1, 1, 1, 0]    -> early q 1 kv 1, late q 0 kv 3 (empty; page 5).
EXAMPLE = dict(extend=[40, 3], prefix=[20, 0], cp=2, rank=0, page_size=16)


# ---- FlashInfer -------------------------------------------------------------------
def make_fi(rec, spec, **kw) -> FlashInferAttention:
    args = dict(max_segments=6, max_pages=12, max_q_rows=24, dtype=torch.bfloat16)
    args.update(kw)
    return FlashInferAttention(spec, "cpu", flashinfer=fake_flashinfer(rec), **args)


def test_flashinfer_wrapper_buffers_and_capacity_plan():
    rec = Recorder()
    fi = make_fi(rec, spec_for(16, "HND"))
    (args, kw), = rec.named("init")
    workspace, layout = args
    assert workspace.dtype == torch.uint8 and workspace.numel() == 128 * 1024 * 1024
    assert layout == "HND" and kw["use_cuda_graph"] is True
    assert kw["qo_indptr_buf"] is fi.qo_indptr_buf and kw["qo_indptr_buf"].shape == (7,)
    assert kw["paged_kv_indptr_buf"].shape == (7,) and kw["paged_kv_last_page_len_buf"].shape == (6,)
    assert kw["paged_kv_indices_buf"].shape == (12,)
    assert all(kw[k].dtype == torch.int32 for k in kw if k.endswith("_buf"))
    # the first plan fixes the row capacity of the graph-mode wrapper: max_q_rows rows
    (plan_args, plan_kw), = rec.named("plan")
    assert plan_args[:4] == ([0, 24, 24, 24, 24, 24, 24], [0, 1, 2, 3, 4, 5, 6], [0] * 6, [1] * 6)


def test_flashinfer_plan_arguments_worked_example():
    rec = Recorder()
    spec = spec_for(16)
    fi = make_fi(rec, spec)
    meta = zigzag_meta(**EXAMPLE)
    assert meta.q_lens_host.tolist() == [10, 10, 1, 0] and meta.kv_lens_host.tolist() == [30, 60, 1, 3]
    fi.prepare(meta)
    args, kw = rec.named("plan")[-1]
    assert args == (
        [0, 10, 20, 21, 21, 21, 21],  # qo_indptr: padded to max_segments, repeating
        [0, 2, 6, 7, 8, 9, 10],  # paged_kv_indptr
        [1, 2, 1, 2, 3, 4, 5, 0, 0, 0],  # indices: empty and padding segments get the scratch page
        [14, 12, 1, 1, 1, 1],  # last_page_len: 30-16, 60-48, 1, then inert segments 1
        8, 2, 64, 16,  # num_qo_heads, num_kv_heads, head_dim, page_size
    )
    assert kw == dict(causal=True, sm_scale=0.125, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)


@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_flashinfer_plan_matches_metadata(page_size):
    """Prefixes, a request shorter than 2C, several page sizes: the plan reproduces
    every live segment's kv length and pages."""
    rec = Recorder()
    spec = spec_for(page_size)
    fi = make_fi(rec, spec, max_segments=8, max_pages=40, max_q_rows=64)
    meta = zigzag_meta([70, 5, 2], [33, 100, 0], cp=2, rank=1, page_size=page_size)
    fi.prepare(meta)
    qo, kv_indptr, indices, last = rec.named("plan")[-1][0][:4]
    assert qo[: meta.num_segments + 1] == meta.cu_seqlens_q_host.tolist()
    assert qo[meta.num_segments :] == [meta.num_q_rows] * (8 - meta.num_segments + 1)
    for s in range(8):
        n = kv_indptr[s + 1] - kv_indptr[s]
        assert 1 <= last[s] <= page_size and n >= 1
        kv_len = (n - 1) * page_size + last[s]
        pages = indices[kv_indptr[s] : kv_indptr[s + 1]]
        if s < meta.num_segments and meta.q_lens_host[s] > 0:
            assert kv_len == meta.kv_lens_host[s]
            assert pages == meta.page_table_host[s, :n].tolist()
        else:
            assert (kv_len, pages) == (1, [0])


def test_flashinfer_run_skips_padding_rows_and_converts_lse():
    rec = Recorder()
    spec = spec_for(16)
    fi = make_fi(rec, spec)
    meta = zigzag_meta(**EXAMPLE)
    q, kv, out, lse = tensors(spec, rows=24)
    fi.prepare(meta)
    fi.forward(q, kv, meta, out, lse)
    (rq, rkv), rkw = rec.named("run")[-1]
    n = meta.num_q_rows
    assert rq.shape[0] == n and rq.data_ptr() == q.data_ptr()  # q[:n]: padding rows are not queries
    assert rkv is kv and rkw["return_lse"] is True
    assert rkw["out"].shape[0] == n and rkw["out"].data_ptr() == out.data_ptr()
    assert rkw["lse"].shape[0] == n and rkw["lse"].data_ptr() == lse.data_ptr()
    torch.testing.assert_close(lse[:n], torch.full((n, 8), BASE2_LSE * LN2))
    assert (lse[n:] == SENTINEL).all() and (out[n:].float() == SENTINEL).all()


def test_flashinfer_without_lse_and_errors():
    rec = Recorder()
    spec = spec_for(16)
    fi = make_fi(rec, spec)
    meta = zigzag_meta(**EXAMPLE)
    q, kv, out, _ = tensors(spec, rows=24)
    with pytest.raises(RuntimeError, match="prepare"):
        fi.forward(q, kv, meta, out)
    fi.prepare(meta)
    fi.forward(q, kv, meta, out)
    assert rec.named("run")[-1][1]["lse"] is None and rec.named("run")[-1][1]["return_lse"] is False
    with pytest.raises(ValueError, match="max_segments=6"):
        fi.prepare(zigzag_meta([8, 8, 8, 8], [0] * 4, 2, 0, 16))
    with pytest.raises(ValueError, match="max_pages=3"):
        make_fi(rec, spec, max_segments=2, max_pages=3).prepare(zigzag_meta([40], [40], 2, 0, 16))
    with pytest.raises(ValueError, match="planned for torch.bfloat16"):
        fi.forward(q.float(), kv, meta, out.float())


# ---- trtllm -----------------------------------------------------------------------
def make_trt(rec, spec, **kw) -> TrtllmAttention:
    args = dict(max_segments=6, max_pages_per_segment=8, max_q_rows=24, capability=BLACKWELL)
    args.update(kw)
    return TrtllmAttention(spec, "cpu", flashinfer=fake_flashinfer(rec), **args)


def test_trtllm_one_call_covers_all_segments():
    rec = Recorder()
    spec = spec_for(16, "HND")
    trt = make_trt(rec, spec)
    assert not trt.supports_full_graph
    meta = zigzag_meta(**EXAMPLE)
    q, kv, out, lse = tensors(spec, rows=24)
    trt.prepare(meta)
    trt.forward(q, kv, meta, out, lse)
    (_, kw), = rec.named("trtllm")  # ONE call: both zigzag segments of both requests
    assert kw["batch_size"] == 4 == 2 * len(EXAMPLE["extend"])
    assert kw["query"] is q and kw["out"] is out and kw["lse"] is lse and kw["kv_cache"] is kv
    assert kw["cum_seq_lens_q"] == [0, 10, 20, 21, 21]  # ends at the real rows: padding rows are no query
    assert kw["seq_lens"] == [30, 60, 1, 1]  # the empty late segment of request 1 is inert
    assert kw["cum_seq_lens_kv"] == [0, 30, 90, 91, 92]
    assert kw["block_tables"] == [
        [1, 2, 3, 4, 0, 0, 0, 0],
        [1, 2, 3, 4, 0, 0, 0, 0],
        [5, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],  # inert: scratch page
    ]
    assert (kw["max_q_len"], kw["max_kv_len"]) == (10, 60)
    assert (kw["bmm1_scale"], kw["bmm2_scale"], kw["window_left"]) == (0.125, 1.0, -1)
    assert kw["kv_layout"] == "HND" and kw["return_lse"] is True
    assert kw["workspace_buffer"].numel() == 128 * 1024 * 1024 and not kw["workspace_buffer"].any()
    n = meta.num_q_rows
    torch.testing.assert_close(lse[:n], torch.full((n, 8), BASE2_LSE * LN2))
    assert (lse[n:] == SENTINEL).all() and (out[n:].float() == SENTINEL).all()


@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_trtllm_arguments_with_prefixes(page_size):
    rec = Recorder()
    spec = spec_for(page_size, "HND")
    trt = make_trt(rec, spec, max_segments=8, max_pages_per_segment=10, max_q_rows=64)
    meta = zigzag_meta([70, 5, 2, 9], [33, 100, 0, 64], cp=2, rank=1, page_size=page_size, width=10)
    q, kv, out, _ = tensors(spec, rows=64)
    trt.prepare(meta)
    trt.forward(q, kv, meta, out)
    (_, kw), = rec.named("trtllm")
    live = meta.q_lens_host > 0
    want_seq = np.where(live, meta.kv_lens_host, 1)
    assert kw["batch_size"] == meta.num_segments == 8
    assert kw["seq_lens"] == want_seq.tolist()
    assert kw["cum_seq_lens_q"] == meta.cu_seqlens_q_host.tolist()
    assert kw["cum_seq_lens_kv"] == [0] + np.cumsum(want_seq).tolist()
    assert kw["max_q_len"] == meta.max_q_len and kw["max_kv_len"] == int(want_seq.max())
    want_table = np.where(live[:, None], meta.page_table_host, 0)
    assert kw["block_tables"] == want_table.tolist()
    assert kw["lse"] is None and kw["return_lse"] is False


def test_trtllm_static_max_lengths_for_graphs():
    rec = Recorder()
    trt = make_trt(rec, spec_for(32, "HND"), max_pages_per_segment=16, static_max_q_len=24, static_max_kv_len=256)
    assert trt.supports_full_graph
    meta = zigzag_meta(**{**EXAMPLE, "page_size": 32})
    q, kv, out, lse = tensors(trt.spec, rows=24)
    trt.prepare(meta)
    trt.forward(q, kv, meta, out, lse)
    (_, kw), = rec.named("trtllm")
    assert (kw["max_q_len"], kw["max_kv_len"]) == (24, 256)
    with pytest.raises(ValueError, match="static_max_kv_len=256"):
        trt.prepare(zigzag_meta([8], [300], 2, 0, 32, width=12))


def test_trtllm_validation():
    rec = Recorder()
    with pytest.raises(RuntimeError, match=r"SM100, SM103; cpu is SM90 \(capability 9.0\)"):
        make_trt(rec, spec_for(16, "HND"), capability=lambda: (9, 0))
    with pytest.raises(RuntimeError, match="SM120"):
        make_trt(rec, spec_for(16, "HND"), capability=lambda: (12, 0))
    make_trt(rec, spec_for(16, "HND"), capability=lambda: (10, 3))  # SM103 is fine
    with pytest.raises(ValueError, match="HND kv cache"):
        make_trt(rec, spec_for(16, "NHD"))
    with pytest.raises(ValueError, match=r"page_size in \(16, 32, 64\), got 8"):
        make_trt(rec, spec_for(8, "HND"))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        TrtllmAttention(spec_for(16, "HND"), "cpu", max_segments=2, max_pages_per_segment=2, max_q_rows=8)
    trt = make_trt(rec, spec_for(16, "HND"))
    meta = zigzag_meta(**EXAMPLE)
    with pytest.raises(RuntimeError, match="prepare"):
        trt.forward(*tensors(trt.spec, rows=24)[:2], meta, torch.empty(0))
    with pytest.raises(ValueError, match="max_pages_per_segment=8"):
        trt.prepare(zigzag_meta([8], [200], 2, 0, 16, width=14))


# ---- imports and selection ---------------------------------------------------------
@pytest.fixture
def no_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    monkeypatch.setitem(sys.modules, "flashinfer.prefill", None)


@pytest.fixture
def fake_installed(monkeypatch):
    rec = Recorder()
    fi = fake_flashinfer(rec)
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.prefill", fi.prefill)
    return rec


def test_import_error_names_the_extra(no_flashinfer):
    with pytest.raises(ImportError, match=r"'flashinfer'.*pip install graphcp\[flashinfer\]"):
        FlashInferAttention(spec_for(16), "cpu", max_segments=2, max_pages=4, max_q_rows=8)
    with pytest.raises(ImportError, match=r"'trtllm'.*pip install graphcp\[flashinfer\]"):
        TrtllmAttention(
            spec_for(16, "HND"), "cpu", max_segments=2, max_pages_per_segment=2, max_q_rows=8, capability=BLACKWELL
        )


def test_backends_import_flashinfer_from_sys_modules(fake_installed):
    FlashInferAttention(spec_for(16), "cpu", max_segments=2, max_pages=4, max_q_rows=8)
    TrtllmAttention(spec_for(16, "HND"), "cpu", max_segments=2, max_pages_per_segment=2, max_q_rows=8, capability=BLACKWELL)
    assert [n for n, _, _ in fake_installed.calls] == ["init", "plan"]


def test_auto_selection(monkeypatch, fake_installed):
    sm = lambda cap: (lambda dev: cap)  # noqa: E731
    assert registry.resolve("auto", "cpu") == "torch"
    assert registry.resolve("auto", "cuda", capability=sm((10, 0))) == "trtllm"
    assert registry.resolve("auto", "cuda", capability=sm((10, 3))) == "trtllm"
    assert registry.resolve("auto", "cuda", "NHD", capability=sm((10, 0))) == "flashinfer"
    assert registry.resolve("auto", "cuda", capability=sm((9, 0))) == "flashinfer"
    assert registry.preferred_kv_layout("auto", "cuda", capability=sm((10, 0))) == "HND"
    assert registry.preferred_kv_layout("trtllm") == "HND"
    assert registry.preferred_kv_layout("flashinfer") == registry.preferred_kv_layout("torch") == "NHD"
    assert registry.available_backends("cuda", capability=sm((10, 0)))[-2:] == ["flashinfer", "trtllm"]
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    assert registry.resolve("auto", "cuda", capability=sm((10, 0))) == "triton"
    monkeypatch.setitem(sys.modules, "triton", None)
    assert registry.resolve("auto", "cuda", capability=sm((10, 0))) == "torch"
    assert registry.available_backends("cpu") == ["torch"]


def test_make_attention(fake_installed):
    spec = spec_for(16)
    assert registry.make_attention("torch", spec, "cpu").name == "torch"
    assert registry.make_attention("auto", spec, "cpu", max_segments=4).name == "torch"  # extras dropped
    fi = registry.make_attention("flashinfer", spec, "cpu", max_segments=2, max_pages=4, max_q_rows=8)
    assert fi.name == "flashinfer" and fi.device == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'; expected one of torch, triton"):
        registry.make_attention("flash", spec, "cpu")
    assert registry.make_attention("torch", spec, "cpu", max_segments=4).name == "torch"
    with pytest.raises(TypeError, match="max_q_rows"):
        registry.make_attention("flashinfer", spec, "cpu", max_segments=2, max_pages=4)
