"""The capture self-check replays each new bucket on a synthetic batch and
compares it bitwise with the same body run eagerly on the same bucket: a Python
scalar baked into a captured body, or a tensor built from host data outside the
static buffers, is a CaptureError at capture time, before any user batch runs."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs its kernels

import numpy as np
import pytest
import torch

from graphcp import PrefillEngine, Request
from graphcp.config import RuntimeConfig
from graphcp.cp import ZigzagLayout
from graphcp.dist import launch
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.capture.graphs import CaptureError
from graphcp.runtime.capture.selfcheck import first_difference, synthetic_batch

DTYPES = ("float32", "bfloat16")
BUCKETS = BucketSet((32, 64), padding_factor=8.0)


@pytest.fixture(scope="module")
def model(hf_model_dir):
    """The tiny tied Qwen3 checkpoint: the default preset's family at a sixteenth of its work."""
    return hf_model_dir("qwen3", True)


def _engine(model, group=None, dtype="float32", verify=None, kv_tokens=2048):
    rt = RuntimeConfig(graph="breakable", kv_tokens=kv_tokens, dtype=dtype, verify_capture=verify)
    return PrefillEngine(model, rt, group, BUCKETS)


def _baked_scalar(eng):
    """The body reads a Python number from the live metadata: capture bakes in the
    capture batch's (no rows), a CUDA graph would too."""
    body = eng.parts.model.body

    def patched(ids, pos, ctx, *stage_input):
        return body(ids, pos, ctx, *stage_input) + 0.01 * int(ctx.attn_meta.cu_seqlens_q_host[-1])  # the live row count

    eng.parts.model.body = patched


def _stale_buffer(eng):
    """The body builds a tensor from host data: made outside the recorded ops, so a
    replay reuses the capture-time one."""
    body = eng.parts.model.body

    def patched(ids, pos, ctx, *stage_input):
        lens = torch.tensor(ctx.attn_meta.kv_lens_host.astype(np.float32))
        return body(ids, pos, ctx, *stage_input) + lens.sum().to(ids.device) * 1e-2

    eng.parts.model.body = patched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inject", [_baked_scalar, _stale_buffer], ids=["baked_scalar", "stale_buffer"])
def test_an_injected_capture_bug_is_a_capture_error(inject, dtype, model):
    eng = _engine(model, dtype=dtype)
    inject(eng)
    free = eng.parts.kv.snapshot()
    with pytest.raises(CaptureError, match=r"self-check of bucket 64: .*hidden_out rows \[0, 1, 2"):
        eng.capture()
    assert eng.parts.kv.snapshot() == free  # the synthetic batch gave its pages back


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_the_check_the_same_bug_returns_wrong_logits(dtype, model):
    """What the check prevents: the graph path silently differs from eager."""
    eng = _engine(model, dtype=dtype, verify=False)
    _baked_scalar(eng)
    eng.capture()
    reqs = [Request(np.arange(40)), Request(np.arange(9) + 7)]
    graph = eng.prefill(reqs)
    eager = eng.prefill(reqs, force_eager=True)
    assert graph.info.path == "graph"
    assert not torch.allclose(graph.last_logits, eager.last_logits, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_correct_capture_passes_and_reports_its_cost(dtype, model):
    eng = _engine(model, dtype=dtype)
    free = eng.parts.kv.snapshot()
    stats = eng.capture()
    assert [s.capacity for s in stats] == [64, 32]
    for s in stats:
        assert s.verify_skipped is None and s.verify_s is not None and s.verify_s > 0
    assert eng.parts.kv.snapshot() == free
    # on by default for the trace backend only; the flag turns it off
    assert all(s.verify_s is None for s in _engine(model, verify=False).capture())


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_graph_with_triton_passes_and_catches_a_baked_scalar(dtype, model):
    """Full graphs capture attention too (static device metadata): the check covers it."""
    pytest.importorskip("triton")
    rt = RuntimeConfig(graph="full", attention="triton", kv_tokens=1024, max_requests=2, dtype=dtype)
    stats = PrefillEngine(model, rt, None, BucketSet((16,))).capture()
    assert stats[0].verify_skipped is None and stats[0].verify_s > 0
    eng = PrefillEngine(model, rt, None, BucketSet((16,)))
    _baked_scalar(eng)
    with pytest.raises(CaptureError, match="bucket 16"):
        eng.capture()


def test_lazy_capture_is_checked_too(model):
    """A bucket first needed by a user batch is captured and checked before it replays."""
    eng = _engine(model)
    _baked_scalar(eng)
    with pytest.raises(CaptureError, match="bucket 64"):
        eng.prefill([Request(np.arange(50))])
    assert eng.parts.kv.num_free_pages == eng.parts.kv.num_pages - 1  # the user batch was rolled back too


def test_a_full_pool_skips_the_check_and_says_why(model):
    eng = _engine(model, kv_tokens=32)  # two pages: the synthetic batch fits a token at most
    held = eng.prefill([Request(np.arange(32))], force_eager=True).handles[0]
    stats = eng.capture()
    assert all(s.verify_s is not None for s in stats)
    assert all(s.verify_skipped == "the KV pool has 0 free pages" for s in stats)
    eng.release(held)


def _cp2_job(group, model, bad_rank):
    eng = _engine(model, group)
    if group.rank == bad_rank:
        _baked_scalar(eng)
    try:
        eng.capture()
    except CaptureError as e:
        return str(e)
    return None


def test_cp2_every_rank_raises_when_one_rank_differs(model):
    msgs = launch(_cp2_job, 2, model, 1)
    assert "hidden_out rows" in msgs[1] and "bucket 64" in msgs[1]
    assert "another rank's output differs" in msgs[0] and msgs[0].startswith("rank 0")


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("capacity", [8, 16, 64, 256])
def test_synthetic_batch_fills_the_bucket_within_the_pool(cp, capacity):
    layout = ZigzagLayout(cp)
    b = synthetic_batch(capacity, layout, free_pages=1000, page_size=16, max_requests=64, max_context=4096)
    plan = layout.plan(extend_lens=list(b.extend_lens), prefix_lens=[b.prefix_len] + [0] * (len(b.extend_lens) - 1))
    assert plan.max_local_rows <= capacity
    assert plan.max_local_rows >= capacity * 7 // 8 - 3  # fills most of the bucket
    assert b.prefix_len == 19 and len(b.extend_lens) == 3 and b.extend_lens[2] < 2 * cp
    # a small pool: the batch shrinks to fit it; an empty one: none
    small = synthetic_batch(capacity, layout, free_pages=3, page_size=16, max_requests=64, max_context=4096)
    assert small is not None and -(-(small.prefix_len + small.extend_lens[0]) // 16) + sum(
        -(-n // 16) for n in small.extend_lens[1:]) <= 3
    assert synthetic_batch(capacity, layout, 0, 16, 64, 4096) is None
    # one request at most: no companions
    assert len(synthetic_batch(capacity, layout, 1000, 16, 1, 4096).extend_lens) == 1


def test_first_difference_names_the_output_rows_and_size():
    a = torch.zeros(6, 4)
    b = a.clone()
    assert first_difference({"hidden_out": (a, b)}) is None
    b[[1, 4], 2] = 0.25
    assert first_difference({"hidden_out": (a, b)}) == "hidden_out rows [1, 4] (2 of 6) differ, max |diff| 0.25"
    nan = torch.full((2, 2), float("nan"))
    assert first_difference({"x": (nan, nan.clone())}) is None
    kv = torch.zeros(3, 2, 2)
    kv2 = kv.clone()
    kv2[2, 0, 1] = 1.0
    assert first_difference({"kv_cache": (kv, kv2)}).startswith("kv_cache layers [2] (1 of 3)")
