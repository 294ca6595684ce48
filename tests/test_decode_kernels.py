"""The paged decode kernels behind the registry (issue 50, docs/decode.md): Triton's (run
in its interpreter), FlashInfer's decode wrapper and trtllm-gen's decode (through the
fakes of ``fake_flashinfer.py``, which model what the real ones bake in at plan time and
return: base-2 LSE), each against the torch reference over one decode bucket: mixed
lengths, rows with no key (a rank that holds none of a request, the bucket's padding
rows) and a page table wider than the longest request needs, with and without LSE, in
float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_copy_engine import FakeCopyEngine
from fake_flashinfer import SM_COUNT, Recorder, fake_flashinfer

from graphcp.attention.backends.flashinfer_decode import FlashInferDecodeAttention, decode_plan_args
from graphcp.attention.backends.triton_decode import TritonDecodeAttention
from graphcp.attention.backends.trtllm_decode import TrtllmDecodeAttention
from graphcp.attention.base import AttentionSpec
from graphcp.attention.decode.paged import PagedDecodeAttention
from graphcp.attention.kernels.paged_decode import split_plan
from graphcp.attention.reference_cases import TOLERANCE, decode_case, run_decode_case
from graphcp.attention.registry import AttentionLimits, decode_kernel_info, make_attention, make_decode_attention

DTYPES = [torch.float32, torch.bfloat16]
#: the acceptance bound of the Triton kernel against the reference in float32 (issue 50)
FLOAT32_BOUND = 1e-5
#: (lengths on this rank, bucket rows, page-table width): mixed, empty shards, page buckets
STEPS = [([37, 0, 5, 130], 4, None), ([1, 300, 0], 8, 40), ([0, 0], 2, 4), ([16, 17, 15, 1, 64], 8, 8)]


def _spec(layout: str, page_size: int = 16, head_dim: int = 32, group: int = 4) -> AttentionSpec:
    return AttentionSpec(2 * group, 2, head_dim, page_size, head_dim ** -0.5, layout)


def _case(lens, rows, width, spec, dtype, seed=0):
    return decode_case(lens, spec, dtype, "cpu", torch.Generator().manual_seed(seed), np.random.default_rng(seed),
                       rows=rows, width=width)


def _check(got, dtype):
    bound = FLOAT32_BOUND if dtype == torch.float32 else TOLERANCE[dtype]
    assert got.padding_untouched, f"a row with no key is not output 0 / LSE -inf: {got}"
    assert got.out <= bound and (got.lse or 0.0) <= bound, got


# ---- Triton ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_triton_decode_equals_the_reference(dtype, layout, splits):
    spec = _spec(layout)
    for j, (lens, rows, width) in enumerate(STEPS):
        case = _case(lens, rows, width, spec, dtype, seed=j)
        for with_lse in (True, False):
            _check(run_decode_case(TritonDecodeAttention(spec, splits), case, with_lse), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_gqa_groups_and_a_wide_head(dtype):
    """A group that is no power of two (lanes padded), MHA, and head_dim 128."""
    for spec in (_spec("NHD", group=3), _spec("HND", group=1), _spec("NHD", head_dim=128, page_size=32)):
        _check(run_decode_case(TritonDecodeAttention(spec), _case([50, 0, 9], 4, None, spec, dtype)), dtype)


def test_triton_decode_reads_only_each_rows_own_pages():
    """Every page no row holds (the scratch page, the pool's spare pages) and every slot
    past a row's length is NaN: the kernel's output stays the reference's. The torch
    reference, which reads the table's whole width, does not."""
    spec = _spec("NHD")
    case = _case([37, 0, 5, 130], 8, 24, spec, torch.float32)
    live = {int(p) for j, n in enumerate(case.live.kv_lens_host) for p in case.live.page_table_host[j, :-(-n // 16)]}
    poisoned = case.kv_nhd.clone()
    for p in range(case.num_pages):
        if p not in live:
            poisoned[p] = float("nan")
    for j, n in enumerate(case.live.kv_lens_host):
        if n % 16:
            poisoned[case.live.page_table_host[j, n // 16], :, n % 16:] = float("nan")
    case.kv_nhd = poisoned
    _check(run_decode_case(TritonDecodeAttention(spec, 3), case), torch.float32)
    assert not run_decode_case(PagedDecodeAttention(spec), case).ok


def test_the_split_plan_fills_the_device_and_bounds_a_split():
    assert split_plan(1, 8, 32768, 64) == (32, 1024)  # one request: ~264 programs over 8 heads
    assert split_plan(64, 8, 2048, 64) == (1, 2048)  # enough programs already
    assert split_plan(1, 1, 100, 64) == (1, 128)  # a split takes at least 256 keys
    splits, chunk = split_plan(2, 2, 1 << 20, 32)
    assert splits == 64 and chunk % 32 == 0 and splits * chunk >= 1 << 20


def test_triton_decode_needs_a_power_of_two_head_dim():
    with pytest.raises(ValueError, match="power-of-two head_dim >= 16, got 24"):
        TritonDecodeAttention(_spec("NHD", head_dim=24))


# ---- FlashInfer's decode wrapper (fake) ----------------------------------------------------
def _flashinfer(spec, dtype, width, rec, engine=None):
    fi = fake_flashinfer(rec, copy_engine=engine)
    return FlashInferDecodeAttention(spec, "cpu", max_pages_per_segment=width, dtype=dtype, flashinfer=fi,
                                     staging=engine, workspace_bytes=1 << 20)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_flashinfer_decode_equals_the_reference(dtype, layout):
    spec = _spec(layout)
    for j, (lens, rows, width) in enumerate(STEPS):
        case = _case(lens, rows, width, spec, dtype, seed=j)
        rec = Recorder()
        kernel = _flashinfer(spec, dtype, case.static.page_table.shape[1], rec)
        for with_lse in (True, False):
            _check(run_decode_case(kernel, case, with_lse), dtype)
        assert not rec.errors, rec.errors
        (init_args, init), = rec.named("decode_init")  # one wrapper a bucket, planned twice
        assert init == dict(use_cuda_graph=True, use_tensor_cores=False, backend="fa2")
        assert len(rec.named("decode_plan")) == 2 and all(k["sm_scale"] == spec.scale
                                                          for _, k in rec.named("decode_plan"))


def test_flashinfer_decode_plans_keyless_rows_on_the_scratch_page():
    indptr, indices, last = decode_plan_args(np.array([33, 0, 16]), np.array([[4, 5, 6], [7, 0, 0], [8, 9, 0]]),
                                             16, rows=5)
    assert indptr.tolist() == [0, 3, 4, 5, 6, 7] and indices.tolist() == [4, 5, 6, 0, 8, 0, 0]
    assert last.tolist() == [1, 1, 16, 1, 1]


def test_flashinfer_decode_keeps_one_wrapper_a_bucket_and_fences_its_pinned_inputs():
    """Steps on two buckets planned while the previous step's copies and kernel are still
    queued (the fake copy engine runs them late): each plan waits for the previous plan's
    copies before rewriting its pinned buffers, and each step's kernel, when it runs,
    reads its own step's indptr, indices and last_page_len from the bucket's buffers."""
    spec, dtype = _spec("NHD"), torch.float32
    rec, engine = Recorder(), FakeCopyEngine()
    kernel = _flashinfer(spec, dtype, 16, rec, engine)
    seen, want = [], []
    for j, (lens, rows) in enumerate([([40, 3], 2), ([7, 0, 90], 4), ([1, 200], 2), ([5, 5, 5, 5], 4)]):
        case = _case(lens, rows, 16, spec, dtype, seed=j)
        kernel.bucket(rows)
        kernel.prepare(case.live)
        wrapper = [k for n, _, k in rec.raw if n.endswith("__init__")][0 if rows == 2 else 1]
        bufs = [wrapper[f"paged_kv_{b}_buffer"] for b in ("indptr", "indices", "last_page_len")]
        engine.launch(lambda b=bufs: seen.append([t.clone() for t in b]))  # the step's kernel reads them
        want.append(decode_plan_args(case.live.kv_lens_host, case.live.page_table_host, 16, rows))
    engine.sync()
    assert not rec.errors, rec.errors
    assert len(rec.named("decode_init")) == 2 and engine.waits >= 2
    for (indptr, indices, last), (w_ptr, w_idx, w_last) in zip(seen, want):
        assert indptr.tolist() == w_ptr.tolist() and last.tolist() == w_last.tolist()
        assert indices[: len(w_idx)].tolist() == w_idx.tolist()


def test_flashinfer_decode_refuses_a_step_the_bucket_cannot_hold():
    spec = _spec("NHD")
    case = _case([40, 3, 9], 4, 8, spec, torch.float32)
    kernel = _flashinfer(spec, torch.float32, 4, Recorder())
    kernel.bucket(4)
    with pytest.raises(ValueError, match="page table of 8 pages, the decode kernel was built for 4"):
        kernel.prepare(case.live)
    kernel.bucket(2)
    with pytest.raises(ValueError, match="4 requests planned on a bucket of 2 rows"):
        kernel.prepare(case.live)


# ---- trtllm-gen decode (fake) --------------------------------------------------------------
def _trtllm(spec, rows, width, rec):
    return TrtllmDecodeAttention(spec, "cpu", max_segments=rows, max_pages_per_segment=width,
                                 capability=lambda: (10, 0), sm_count=SM_COUNT, flashinfer=fake_flashinfer(rec),
                                 workspace_bytes=1 << 20)


@pytest.mark.parametrize("dtype", DTYPES)
def test_trtllm_decode_equals_the_reference(dtype):
    spec = _spec("HND")
    for j, (lens, rows, width) in enumerate(STEPS):
        case = _case(lens, rows, width, spec, dtype, seed=j)
        rec = Recorder()
        kernel = _trtllm(spec, 8, 40, rec)  # built for the largest bucket: this one is a view of its buffers
        for with_lse in (True, False):
            _check(run_decode_case(kernel, case, with_lse), dtype)
        assert not rec.errors and rec.counter_allocations == 0
        calls = [k for _, k in rec.named("trtllm_decode")]
        assert all(k["block_tables_contiguous"] and k["backend"] == "trtllm-gen" and k["kv_layout"] == "HND"
                   and min(k["seq_lens"]) >= 1 and k["max_seq_len"] == case.static.page_table.shape[1] * 16
                   for k in calls)
        assert [k["return_lse"] for k in calls] == [True, False]


def test_trtllm_decode_needs_blackwell_an_hnd_cache_and_a_supported_page():
    with pytest.raises(ValueError, match="HND"):
        _trtllm(_spec("NHD"), 4, 4, Recorder())
    with pytest.raises(ValueError, match="page_size in"):
        _trtllm(_spec("HND", page_size=8), 4, 4, Recorder())
    with pytest.raises(Exception, match=r"9\.0|sm_?90|capability"):
        TrtllmDecodeAttention(_spec("HND"), "cpu", max_segments=4, max_pages_per_segment=4,
                              capability=lambda: (9, 0), sm_count=SM_COUNT, flashinfer=fake_flashinfer(Recorder()))


# ---- the registry --------------------------------------------------------------------------
def test_each_backend_has_its_decode_kernel_and_a_familys_own_gets_the_reference():
    from graphcp.attention.backends.torch_ref import TorchAttention
    from graphcp.attention.registry import registered_decode_kernel

    assert {n: decode_kernel_info(n).cls for n in ("torch", "triton", "flashinfer", "trtllm")} == {
        "torch": PagedDecodeAttention, "triton": TritonDecodeAttention, "flashinfer": FlashInferDecodeAttention,
        "trtllm": TrtllmDecodeAttention}
    assert [n for n in ("torch", "triton", "flashinfer", "trtllm") if decode_kernel_info(n).cls.any_batch] == [
        "torch", "triton"]  # the kernels an eager decode step runs too

    class FamilysOwn(TorchAttention):  # a family's backend, named as a registered one
        name = "triton"

    spec = _spec("NHD")
    assert registered_decode_kernel(FamilysOwn(spec)) is None
    assert decode_kernel_info(FamilysOwn(spec)).cls is PagedDecodeAttention
    limits = AttentionLimits(max_segments=8, max_q_rows=8, max_pages_per_segment=16, dtype=torch.float32)
    assert isinstance(make_decode_attention(TorchAttention(spec), "cpu", limits), PagedDecodeAttention)
    assert isinstance(make_decode_attention(FamilysOwn(spec), "cpu", limits), PagedDecodeAttention)
    assert isinstance(make_decode_attention(make_attention("triton", spec, "cpu"), "cpu", limits),
                      TritonDecodeAttention)
