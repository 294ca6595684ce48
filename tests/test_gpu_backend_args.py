"""The argument contract of the FlashInfer and trtllm backends, against fakes of
flashinfer that record every call and compute what the real kernels compute,
including where the real kernels write more than asked (``fake_flashinfer.py``;
no GPU, no flashinfer install, real kernels are never called). Outputs and LSE
are checked against the torch reference in float32 and bfloat16. Capture and
replay are in ``test_gpu_backend_graphs.py``.

Plans are zigzag segment lists built by hand (``backend_cases.py``): for every
request the rank's early block r and late block 2C-1-r, with ``kv_len = prefix +
tokens up to the end of the block``.
"""

from __future__ import annotations

import sys
import types

import fake_flashinfer as fake_fi
import numpy as np
import pytest
import torch
from backend_cases import EXAMPLE, check_against_reference, num_pages_for, spec_for, static_meta, zigzag_meta
from fake_flashinfer import (
    HOPPER_SM_COUNT,
    SM_COUNT,
    STALE_LSE,
    Recorder,
    counter_bytes,
    fa2_plan_workspace,
    fake_flashinfer,
)

from graphcp.attention import registry
from graphcp.attention.backends.flashinfer import DEFAULT_WORKSPACE_BYTES, FlashInferAttention
from graphcp.attention.backends.trtllm import TrtllmAttention, lse_stats_bytes
from graphcp.attention.base import AttentionSpec
from graphcp.attention.reference_cases import SENTINEL, tensors
from graphcp.errors import ConfigError

BLACKWELL = lambda: (10, 0)  # noqa: E731
DTYPES = [torch.float32, torch.bfloat16]


# ---- FlashInfer -------------------------------------------------------------------
def make_fi(rec, spec, capability=(10, 0), **kw) -> FlashInferAttention:
    args = dict(max_segments=6, max_pages=12, max_q_rows=24, dtype=torch.bfloat16)
    args.update(kw)
    return FlashInferAttention(spec, "cpu", flashinfer=fake_flashinfer(rec, capability), **args)


def test_flashinfer_wrapper_buffers_fa2_and_capacity_plan():
    rec = Recorder()
    fi = make_fi(rec, spec_for(16, "HND"))
    (args, kw), = rec.named("init")
    workspace, layout = args
    assert workspace.dtype == torch.uint8 and workspace.numel() == 128 * 1024 * 1024
    assert layout == "HND" and kw["use_cuda_graph"] is True
    # FA2: its kernels read row counts from device buffers, so captured launches replay for any batch
    assert kw["backend"] == "fa2" and fi.wrapper.backend == "fa2"
    assert kw["qo_indptr_buf"] is fi.qo_indptr_buf and kw["qo_indptr_buf"].shape == (7,)
    assert kw["paged_kv_indptr_buf"].shape == (7,) and kw["paged_kv_last_page_len_buf"].shape == (6,)
    assert kw["paged_kv_indices_buf"].shape == (12,)
    assert all(kw[k].dtype == torch.int32 for k in kw if k.endswith("_buf"))
    # the first plan fixes the row capacity of the graph-mode wrapper: max_q_rows rows
    (plan_args, plan_kw), = rec.named("plan")
    assert plan_args[:4] == ([0, 24, 24, 24, 24, 24, 24], [0, 1, 2, 3, 4, 5, 6], [0] * 6, [1] * 6)
    assert fi.wrapper.max_rows == 24


def test_flashinfer_on_hopper_stays_on_fa2():
    """On SM90 the wrapper's default, auto, locks onto FA3 at the first plan (a
    query longer than 64 rows); the backend must not let it."""
    rec = Recorder()
    fi = make_fi(rec, spec_for(16), capability=(9, 0), max_q_rows=256)
    assert fi.wrapper.backend == "fa2"


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
    assert kw == dict(causal=True, sm_scale=0.125, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                      disable_split_kv=True)


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_flashinfer_matches_reference_and_skips_padding(dtype, layout):
    rec = Recorder()
    spec = spec_for(16, layout)
    fi = make_fi(rec, spec, max_segments=8, max_pages=40, max_q_rows=64, dtype=dtype)
    meta = zigzag_meta([70, 5, 2], [33, 100, 0], cp=2, rank=1, page_size=16)
    q, kv, out, lse = tensors(spec, 64, num_pages_for(meta), dtype)
    fi.prepare(meta)
    fi.forward(q, kv, meta, out, lse)
    (rq, rkv), rkw = rec.named("run")[-1]
    n = meta.num_q_rows
    assert rq.shape[0] == n and rq.data_ptr() == q.data_ptr()  # q[:n]: padding rows are not queries
    assert rkv is kv and rkw["return_lse"] is True
    check_against_reference(spec, q, kv, meta, out, lse)  # base-2 LSE converted to base e
    out2 = torch.full_like(out, SENTINEL)
    fi.forward(q, kv, meta, out2)  # without LSE: the same output
    assert rec.named("run")[-1][1]["lse"] is None and torch.equal(out2, out)
    assert not rec.errors


def test_flashinfer_capture_plan_covers_the_bucket():
    """Static (full-graph capture) metadata: the plan covers the bucket's rows as
    one causal segment over as many scratch keys (every row sees one), so the
    captured run takes the whole q; its warm-up output is finite."""
    rec = Recorder()
    spec = spec_for(16)
    fi = make_fi(rec, spec, max_q_rows=40, max_pages=12, dtype=torch.float32)
    meta = static_meta(6, 4, 16, 40, torch.zeros(7, dtype=torch.int32), torch.zeros(6, dtype=torch.int32),
                       torch.zeros(6, 4, dtype=torch.int32))
    fi.prepare(meta)
    args, _ = rec.named("plan")[-1]
    assert args[:4] == ([0] + [40] * 6, [0, 3, 4, 5, 6, 7, 8], [0] * 8, [8, 1, 1, 1, 1, 1])
    q, kv, out, lse = tensors(spec, 40, 4, torch.float32)
    fi.forward(q, kv, meta, out, lse)
    (rq, _), _ = rec.named("run")[-1]
    assert rq.shape[0] == 40 and torch.isfinite(out).all() and torch.isfinite(lse).all()
    with pytest.raises(ValueError, match="q has 24 rows, the static metadata bounds 40"):
        fi.forward(q[:24], kv, meta, out[:24])


def test_flashinfer_zero_rows_make_no_call():
    """A batch whose rows are all elsewhere (or a breakable capture's empty
    metadata) launches nothing: zero-row launches fail on some kernels."""
    rec = Recorder()
    spec = spec_for(16)
    fi = make_fi(rec, spec, capability=(9, 0))
    meta = zigzag_meta([1], [0], cp=2, rank=3 - 2, page_size=16)  # C = 2, rank 1: blocks [1,0,0,0]
    assert meta.num_q_rows == 0
    q, kv, out, lse = tensors(spec, 8, num_pages_for(meta))
    fi.prepare(meta)
    fi.forward(q, kv, meta, out, lse)
    assert rec.named("run") == [] and not rec.errors
    assert (out.float() == SENTINEL).all() and (lse == SENTINEL).all()


def test_flashinfer_errors():
    rec = Recorder()
    spec = spec_for(16)
    fi = make_fi(rec, spec)
    meta = zigzag_meta(**EXAMPLE)
    q, kv, out, _ = tensors(spec, 24, num_pages_for(meta))
    with pytest.raises(RuntimeError, match="prepare"):
        fi.forward(q, kv, meta, out)
    fi.prepare(meta)
    with pytest.raises(ValueError, match="max_segments=6"):
        fi.prepare(zigzag_meta([8, 8, 8, 8], [0] * 4, 2, 0, 16))
    with pytest.raises(ValueError, match="max_pages=3"):
        make_fi(rec, spec, max_segments=2, max_pages=3).prepare(zigzag_meta([40], [40], 2, 0, 16))
    with pytest.raises(ValueError, match="planned for torch.bfloat16"):
        fi.forward(q.float(), kv, meta, out.float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_flashinfer_plan_waits_for_the_previous_schedule_upload(dtype):
    """plan uploads its schedule from the wrapper's pinned buffer asynchronously; with the
    host running ahead (a pipeline stage before the last, two micro-batches) the next plan
    must not rewrite that buffer before the previous upload ran. Fake copy engine: uploads
    run only at a wait or a sync; the fake wrapper records a rewrite over a queued upload."""
    from fake_copy_engine import FakeCopyEngine

    eng, rec = FakeCopyEngine(), Recorder()
    spec = spec_for(16)
    fi = FlashInferAttention(spec, "cpu", flashinfer=fake_flashinfer(rec, copy_engine=eng), max_segments=6,
                             max_pages=12, max_q_rows=24, dtype=dtype, staging=eng)
    metas = [zigzag_meta(**EXAMPLE), zigzag_meta([8, 8], [0, 4], 2, 0, 16)]
    for meta in metas:
        q, kv, out, lse = tensors(spec, 24, num_pages_for(metas[0]), dtype)
        fi.prepare(meta)
        eng.launch(lambda: None)  # the layers' kernels, queued behind the upload
        fi.forward(q, kv, meta, out, lse)
        check_against_reference(spec, q, kv, meta, out, lse)
    eng.sync()
    assert not rec.errors, rec.errors
    assert eng.waits == 2 and int(fi.wrapper.device_schedule[0]) == metas[1].num_q_rows


#: the engine's sizes at its defaults: max_q_rows = max(largest bucket, pool rows), 2 x max_requests segments
DEFAULT_ROWS, DEFAULT_SEGMENTS = 65552, 128
#: (query heads, KV heads, head_dim): the default preset, qwen3-1b-like, an 8B-like model
MODELS = {"default": (8, 2, 64), "qwen3-1b-like": (16, 8, 128), "8b-like": (32, 8, 128)}


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)], ids=["sm90", "sm100"])
@pytest.mark.parametrize("model", MODELS)
def test_flashinfer_plans_at_the_engine_default_sizes(model, capability):
    """In CUDA-graph mode FA2 splits the keys unless told not to and carves tmp_v (heads x
    the row capacity's tiles x head_dim x 4 B) from the float workspace: at the engine's
    default 65,552 rows that overflows the 128 MiB workspace for every model here (the
    real plan raised "Buffer overflow ... Increase the workspace buffer size" at the first
    call). The backend plans with split-KV off: no float workspace, and the capacity plan
    and a real plan succeed."""
    heads, kv, d = MODELS[model]
    sms = HOPPER_SM_COUNT if capability[0] == 9 else SM_COUNT
    need, _, split = fa2_plan_workspace(DEFAULT_ROWS, DEFAULT_SEGMENTS, heads, kv, d, sms, disable_split_kv=False)
    assert split and need > DEFAULT_WORKSPACE_BYTES, need  # default ~143 MB, 8B-like ~1.1 GB
    assert fa2_plan_workspace(DEFAULT_ROWS, DEFAULT_SEGMENTS, heads, kv, d, sms, disable_split_kv=True)[:1] == (0,)
    rec = Recorder()
    spec = AttentionSpec(heads, kv, d, 16, d ** -0.5, "HND")
    fi = make_fi(rec, spec, capability, max_segments=DEFAULT_SEGMENTS, max_pages=4 * DEFAULT_SEGMENTS,
                 max_q_rows=DEFAULT_ROWS)
    fi.prepare(zigzag_meta(**EXAMPLE))
    plans = rec.named("plan")
    assert len(plans) == 2 and all(kw["disable_split_kv"] is True for _, kw in plans)
    assert fi.wrapper.max_rows == DEFAULT_ROWS


def test_flashinfer_plan_failure_is_a_config_error(monkeypatch):
    """A plan the library refuses (its allocator's RuntimeError) is one line of ConfigError
    naming the sizes (here the int workspace is made too small for the tile schedule)."""
    monkeypatch.setattr(fake_fi, "INT_WORKSPACE_BYTES", 64)
    with pytest.raises(ConfigError) as err:
        make_fi(Recorder(), spec_for(16))
    msg = str(err.value)
    assert "\n" not in msg and isinstance(err.value.__cause__, RuntimeError)
    assert msg.startswith("flashinfer plan failed for 24 query rows (capacity max_q_rows=24), 6 segments, 8/2 heads "
                          "x 64, float workspace 134217728 B: Buffer overflow when allocating memory for "
                          "batch_prefill_"), msg


# ---- trtllm -----------------------------------------------------------------------
def make_trt(rec, spec, **kw) -> TrtllmAttention:
    args = dict(max_segments=6, max_pages_per_segment=8, max_q_rows=24, capability=BLACKWELL, sm_count=SM_COUNT)
    args.update(kw)
    return TrtllmAttention(spec, "cpu", flashinfer=fake_flashinfer(rec), **args)


def test_trtllm_one_call_covers_all_segments():
    rec = Recorder()
    spec = spec_for(16, "HND")
    trt = make_trt(rec, spec)
    assert not trt.supports_full_graph
    meta = zigzag_meta(**EXAMPLE)
    q, kv, out, lse = tensors(spec, 24, num_pages_for(meta))
    trt.prepare(meta)
    trt.forward(q, kv, meta, out, lse)
    (_, kw), = rec.named("trtllm")  # ONE call: both zigzag segments of both requests
    n = meta.num_q_rows
    assert kw["batch_size"] == 4 == 2 * len(EXAMPLE["extend"])
    # the live rows only: the kernel writes LSE for every row of the query it is given
    for name, full in (("query", q), ("out", out), ("lse", lse)):
        assert kw[name].shape[0] == n and kw[name].data_ptr() == full.data_ptr()
    assert kw["kv_cache"] is kv
    assert kw["cum_seq_lens_q"] == [0, 10, 20, 21, 21]
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
    check_against_reference(spec, q, kv, meta, out, lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_trtllm_lse_padding_rows_untouched(dtype):
    """Finding 3: trtllm-gen writes LSE for all of ``query``'s rows (stale
    statistics past the live ones); the backend gives it the live rows only."""
    rec = Recorder()
    spec = spec_for(16, "HND")
    trt = make_trt(rec, spec, max_segments=8, max_pages_per_segment=10, max_q_rows=64)
    meta = zigzag_meta([70, 5, 2, 9], [33, 100, 0, 64], cp=2, rank=1, page_size=16, width=10)
    q, kv, out, lse = tensors(spec, 64, num_pages_for(meta), dtype)
    trt.prepare(meta)
    trt.forward(q, kv, meta, out, lse)
    assert not (lse == STALE_LSE).any()
    check_against_reference(spec, q, kv, meta, out, lse)


def test_trtllm_lse_statistics_formula():
    """The launcher's softmax statistics: heads x batch x round_up(max_q_len, 256) float2 +
    1 MiB; the issue's ring step (64 heads, 16 segments, 32K rows) needs 268 MB, past the
    default workspace."""
    assert lse_stats_bytes(64, 16, 32768) == 8 * 64 * 16 * 32768 + (1 << 20) > DEFAULT_WORKSPACE_BYTES
    assert lse_stats_bytes(8, 3, 257) == 8 * 8 * 3 * 512 + (1 << 20)


@pytest.mark.parametrize("dtype", DTYPES)
def test_trtllm_grows_the_workspace_for_lse_statistics(dtype):
    """A call returning LSE whose statistics do not fit the workspace (here a 1 MiB one: the
    guard alone fills it) grows it first, zeroed; the result equals the reference. The old
    backend passed the fixed workspace and trtllm-gen's allocator overflowed."""
    rec = Recorder()
    spec = spec_for(16, "HND")
    trt = make_trt(rec, spec, max_segments=8, max_pages_per_segment=10, max_q_rows=64, workspace_bytes=1 << 20)
    meta = zigzag_meta([70, 5, 2, 9], [33, 100, 0, 64], cp=2, rank=1, page_size=16, width=10)
    q, kv, out, lse = tensors(spec, 64, num_pages_for(meta), dtype)
    trt.prepare(meta)
    trt.forward(q, kv, meta, out)  # no LSE: no statistics, the workspace stays
    assert trt.workspace.numel() == 1 << 20
    trt.prepare(meta)
    trt.forward(q, kv, meta, out, lse)
    b, max_q, _ = trt._batch
    assert trt.workspace.numel() == lse_stats_bytes(spec.num_q_heads, b, max_q) and not trt.workspace.any()
    assert rec.named("trtllm")[-1][1]["workspace_buffer"] is trt.workspace
    check_against_reference(spec, q, kv, meta, out, lse)


@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_trtllm_arguments_with_prefixes(page_size):
    rec = Recorder()
    spec = spec_for(page_size, "HND")
    trt = make_trt(rec, spec, max_segments=8, max_pages_per_segment=10, max_q_rows=64)
    meta = zigzag_meta([70, 5, 2, 9], [33, 100, 0, 64], cp=2, rank=1, page_size=page_size, width=10)
    q, kv, out, _ = tensors(spec, 64, num_pages_for(meta), torch.float32)
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
    check_against_reference(spec, q, kv, meta, out, None)


def test_trtllm_one_persistent_counter_buffer():
    """Finding 5: without a counter buffer FlashInfer allocates and zeroes one per
    call; the backend passes its own, the same tensor every call and layer."""
    rec = Recorder()
    spec = spec_for(16, "HND")
    trt = make_trt(rec, spec)
    assert trt.counters.numel() == counter_bytes(6, 8)  # FlashInfer's size for 6 segments x 8 heads
    meta = zigzag_meta(**EXAMPLE)
    q, kv, out, lse = tensors(spec, 24, num_pages_for(meta))
    for _ in range(3):  # forwards
        trt.prepare(meta)
        for _ in range(2):  # layers
            trt.forward(q, kv, meta, out, lse)
    bufs = [kw["multi_ctas_kv_counter_buffer"] for _, kw in rec.named("trtllm")]
    assert len(bufs) == 6 and all(b is trt.counters for b in bufs)
    assert rec.counter_allocations == 0


def test_trtllm_zero_rows_make_no_call():
    rec = Recorder()
    spec = spec_for(16, "HND")
    trt = make_trt(rec, spec)
    meta = zigzag_meta([1], [0], cp=2, rank=1, page_size=16)
    q, kv, out, lse = tensors(spec, 8, num_pages_for(meta))
    trt.prepare(meta)
    trt.forward(q, kv, meta, out, lse)
    assert rec.named("trtllm") == [] and not rec.errors and (lse == SENTINEL).all()


def test_trtllm_static_max_lengths_pad_the_batch():
    """Finding 4 (arguments): with static maxima the batch is always max_segments
    long, live segments first, then inert ones."""
    rec = Recorder()
    trt = make_trt(rec, spec_for(32, "HND"), max_pages_per_segment=16, static_max_q_len=24, static_max_kv_len=256)
    assert trt.supports_full_graph
    meta = zigzag_meta(**{**EXAMPLE, "page_size": 32})
    q, kv, out, lse = tensors(trt.spec, 24, 17, torch.float32)
    trt.prepare(meta)
    trt.forward(q, kv, meta, out, lse)
    (_, kw), = rec.named("trtllm")
    assert (kw["max_q_len"], kw["max_kv_len"], kw["batch_size"]) == (24, 256, 6)
    assert kw["cum_seq_lens_q"] == [0, 10, 20, 21, 21, 21, 21]
    assert kw["seq_lens"] == [30, 60, 1, 1, 1, 1]
    assert kw["cum_seq_lens_kv"] == [0, 30, 90, 91, 92, 93, 94]
    check_against_reference(trt.spec, q, kv, meta, out, lse)
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
    with pytest.raises(ValueError, match="sm_count is needed"):
        make_trt(rec, spec_for(16, "HND"), sm_count=None)
    trt = make_trt(rec, spec_for(16, "HND"))
    meta = zigzag_meta(**EXAMPLE)
    with pytest.raises(RuntimeError, match="prepare"):
        trt.forward(*tensors(trt.spec, 24, 8)[:2], meta, torch.empty(0))
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
    with pytest.raises(ImportError, match=r"'flashinfer'.*pip install -e \"\.\[flashinfer\]\""):
        FlashInferAttention(spec_for(16), "cpu", max_segments=2, max_pages=4, max_q_rows=8)
    with pytest.raises(ImportError, match=r"'trtllm'.*pip install -e \"\.\[flashinfer\]\""):
        TrtllmAttention(
            spec_for(16, "HND"), "cpu", max_segments=2, max_pages_per_segment=2, max_q_rows=8, capability=BLACKWELL
        )


def test_backends_import_flashinfer_from_sys_modules(fake_installed):
    FlashInferAttention(spec_for(16), "cpu", max_segments=2, max_pages=4, max_q_rows=8)
    TrtllmAttention(spec_for(16, "HND"), "cpu", max_segments=2, max_pages_per_segment=2, max_q_rows=8,
                    capability=BLACKWELL, sm_count=SM_COUNT)
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
