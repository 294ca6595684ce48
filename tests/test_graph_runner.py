"""Breakable-graph replay equals the same body run eagerly on the same bucket
(bitwise) and the unpadded eager forward (within rounding), across CP sizes,
prefix extends and a sequence of batch sizes, in float32 and bfloat16; fallbacks
are counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cp_utils import rel_err
from helpers import graph_then_eager

from graphcp import PrefillEngine, Request
from graphcp.config import RuntimeConfig
from graphcp.dist import CPGroup, launch
from graphcp.runtime.capture.buckets import FALLBACK_PADDING, FALLBACK_TOO_LARGE, BucketSet
from graphcp.runtime.capture.runner import ReplayInputError

BUCKETS = BucketSet((16, 32, 64, 128, 256), padding_factor=64.0)  # small batches replay too
DTYPES = ("float32", "bfloat16")
#: graph (padded rows) vs the unpadded eager forward: a matmul over more rows may
#: round differently; bfloat16 rounds at 2^-8
UNPADDED_TOL = {"float32": 1e-6, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def model(hf_model_dir):
    """The tiny tied Qwen3 checkpoint (the default preset's family at a sixteenth of its
    work: every batch below runs several bodies on several buckets)."""
    return hf_model_dir("qwen3", True)


def _engine(model, group=None, buckets=BUCKETS, **kw):
    rt = RuntimeConfig(graph="breakable", kv_tokens=8192, debug_graphs=True, **kw)
    return PrefillEngine(model, rt, group, buckets)


def _sequence(cp: int, vocab: int, seed: int):
    """A large batch, small ones, then both sides of a bucket boundary (64 | 65 rows)."""
    rng = np.random.default_rng(seed)
    big = [int(x) for x in rng.integers(1, 120 * cp, 5)]
    return [
        (big, [0, 13, 0, 100, 1]),
        ([3, 1, 17], [0, 0, 5]),
        ([cp * 64], [0]),  # exactly 64 local rows on every rank
        ([cp * 64 + cp], [11]),  # 65: the next bucket
        ([1], [0]),
    ]


def _prefixed(engine, prefix_lens, rng):
    handles = []
    for p in prefix_lens:
        handles.append(engine.prefill([Request(rng.integers(0, engine.cfg.vocab_size, p))]).handles[0] if p else None)
    return handles


def _equality_job(group, model, seed: int, dtype: str):
    eng = _engine(model, group, dtype=dtype)
    # capture (and self-check) first: a lazy capture between the eager body and the
    # replay below would refill the buffers, and padding rows (in no attention
    # segment) keep whatever attention output an earlier batch left there
    eng.capture()
    vocab = eng.cfg.vocab_size
    rng = np.random.default_rng(seed + 1)
    report = []
    for lens, prefix in _sequence(group.size, vocab, seed):
        handles = _prefixed(eng, prefix, rng)
        reqs = [Request(rng.integers(0, vocab, n), h) for n, h in zip(lens, handles)]
        prep = eng.parts.preparer.prepare(reqs)
        sel = eng.parts.runner.select(prep.plan.max_local_rows)
        assert sel.graph, (lens, sel)
        same_bucket = eng.parts.runner.eager_on_bucket(prep, sel.capacity).clone()
        unpadded = eng.parts.body.eager(prep, prep.plan.max_local_rows).clone()
        hidden, info = eng.parts.runner.try_replay(prep)
        n = prep.ids.shape[0]
        report.append((sel.capacity, info.path, bool(torch.equal(hidden, same_bucket)),
                       rel_err(hidden[:n], unpadded[:n]) if n else 0.0))
        eng.parts.preparer.abort(prep)
        for h in handles:
            if h is not None:
                eng.release(h)
    return report, eng.parts.runner.stats.replays


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_replay_equals_eager_on_the_same_bucket(cp, dtype, model):
    results = [_equality_job(CPGroup(), model, 3, dtype)] if cp == 1 else launch(_equality_job, cp, model, 3, dtype)
    for report, replays in results:
        caps = [r[0] for r in report]
        assert caps[2] == 64 and caps[3] == 128  # the boundary batches land on both sides
        for cap, path, bitwise, err in report:
            assert path == "graph"
            assert bitwise, f"bucket {cap}: replay differs from the eager body on the same buffers"
            assert err <= UNPADDED_TOL[dtype], f"bucket {cap}: {err}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_prefill_equals_eager_prefill_logits(dtype, model):
    graph, eager = _engine(model, dtype=dtype), PrefillEngine(model, RuntimeConfig(kv_tokens=8192, dtype=dtype))
    rng = np.random.default_rng(0)
    for lens in ([200, 7, 1], [30], [90, 90]):
        toks = [rng.integers(0, graph.cfg.vocab_size, n) for n in lens]
        a = graph.prefill([Request(t) for t in toks], all_logits=True)
        b = eager.prefill([Request(t) for t in toks], all_logits=True)
        assert a.info.path == "graph"
        assert rel_err(a.last_logits, b.last_logits) <= UNPADDED_TOL[dtype]
        for x, y in zip(a.logits, b.logits):
            assert rel_err(x, y) <= UNPADDED_TOL[dtype]


def test_fallbacks_run_eagerly_and_are_counted(model):
    eng = _engine(model, buckets=BucketSet((16, 32)))
    rng = np.random.default_rng(0)
    ref = PrefillEngine(model, RuntimeConfig(kv_tokens=8192))
    too_large = [rng.integers(0, eng.cfg.vocab_size, 100)]
    over_factor = [rng.integers(0, eng.cfg.vocab_size, 6)]  # 6 rows: bucket 16 pads past 2x
    for toks, reason in ((too_large, FALLBACK_TOO_LARGE), (over_factor, FALLBACK_PADDING)):
        out = eng.prefill([Request(t) for t in toks])
        assert out.info.path == "eager" and out.info.fallback == reason
        assert rel_err(out.last_logits, ref.prefill([Request(t) for t in toks]).last_logits) <= 1e-6
    assert eng.parts.runner.stats.fallbacks == {FALLBACK_TOO_LARGE: 1, FALLBACK_PADDING: 1}
    assert eng.parts.runner.stats.replays == 0


def test_capture_stats_and_largest_first(model):
    eng = _engine(model, buckets=BucketSet((16, 32, 64)))
    stats = eng.capture()
    assert [s.capacity for s in stats] == [64, 32, 16]
    for s in stats:
        assert s.segments == eng.cfg.num_layers + 1 and s.breaks == eng.cfg.num_layers
        assert len(s.ops_per_segment) == s.segments and all(n > 0 for n in s.ops_per_segment)


def test_debug_mode_detects_moved_static_buffers(model):
    eng = _engine(model, buckets=BucketSet((32,)))
    toks = [np.arange(20)]
    assert eng.prefill([Request(t) for t in toks]).info.path == "graph"
    eng.parts.runner.buffers.input_ids = torch.zeros_like(eng.parts.runner.buffers.input_ids)  # a reallocation
    with pytest.raises(ReplayInputError, match="moved since capture: \\['input_ids'\\]"):
        eng.prefill([Request(t) for t in toks])


def test_replay_rejects_inputs_unlike_the_capture(model):
    eng = _engine(model, buckets=BucketSet((32,)))
    eng.prefill([Request(np.arange(20))])
    eng.parts.runner.buffers.positions = eng.parts.runner.buffers.positions.to(torch.int32)
    with pytest.raises(ReplayInputError, match="positions is .*torch.int32.*captured as .*torch.int64"):
        eng.prefill([Request(np.arange(20))])


def test_degrees_graphcp_does_not_run_cannot_be_set():
    # (the layouts and backends a full graph refuses: tests/test_combinations.py)
    from graphcp.config import ParallelConfig

    # degrees graphcp does not run have no field: they cannot be set and ignored (tp and dp
    # are the mesh's: docs/parallel.md; tp defaults to cp x dp)
    assert ParallelConfig(cp_size=2).tp_size == 2 and ParallelConfig(cp_size=2, dp_size=2).tp_size == 4
    with pytest.raises(TypeError):
        ParallelConfig(cp_size=2, ep_size=2)


def test_bucket_file_mismatch_is_an_error(tmp_path, model):
    BucketSet((16, 32), cp_size=4, layout="zigzag").save(tmp_path / "b.json")
    with pytest.raises(ValueError, match="tuned for cp_size=4, this run has cp_size=1"):
        _engine(model, buckets=BucketSet.load(tmp_path / "b.json"))


def test_replacing_a_buffer_is_caught_without_debug_mode(model):
    eng = PrefillEngine(model, RuntimeConfig(graph="breakable", kv_tokens=2048), None, BucketSet((32,)))
    eng.prefill([Request(np.arange(20))])
    eng.prefill([Request(np.arange(20))])  # checked once, then trusted while the buffers stay
    eng.parts.runner.buffers.positions = eng.parts.runner.buffers.positions.to(torch.int32)
    with pytest.raises(ReplayInputError, match="positions is .*torch.int32.*captured as .*torch.int64"):
        eng.prefill([Request(np.arange(20))])


def _interleave_job(group, model, dtype):
    """The interleave layout on breakable graphs: graph path and eager, with a prefix."""
    eng = _engine(model, group, layout="interleave", dtype=dtype)
    rng = np.random.default_rng(5)
    toks = [rng.integers(0, eng.cfg.vocab_size, n) for n in (3, 130, 1, 47)]
    outs = graph_then_eager(eng, toks, rng.integers(0, eng.cfg.vocab_size, 40), extends=1)
    return {p: (o.info.path, [x.clone() for x in o.logits]) for p, o in outs.items()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_interleave_layout_replays_breakable_graphs(dtype, model):
    """Breakable graphs take the interleave layout (its one-row segments are read live
    in the break); the capture self-check compared each bucket bitwise with the eager
    body, and the replay agrees with the unpadded eager forward."""
    for rank, res in enumerate(launch(_interleave_job, 2, model, dtype)):
        (gpath, glogits), (epath, elogits) = res["graph"], res["eager"]
        assert (gpath, epath) == ("graph", "eager"), rank
        for j, (g, e) in enumerate(zip(glogits, elogits)):
            assert rel_err(g, e) < UNPADDED_TOL[dtype], f"rank {rank}, request {j}: {rel_err(g, e):.3g}"


def test_cuda_pool_bytes_count_only_the_graph_pool(monkeypatch):
    """The capture stats' pool_bytes is the graphs' own pool (its allocator segments), not
    memory_reserved (every pool and the eager allocations): a snapshot with an eager
    segment, another pool's and another device's counts only this pool's on this device."""
    from graphcp.runtime.capture import graphs

    snapshot = [
        {"device": 0, "total_size": 2 << 20, "segment_pool_id": (0, 0)},  # eager allocations
        {"device": 0, "total_size": 20 << 20, "segment_pool_id": (1, 7)},  # the graphs' pool
        {"device": 0, "total_size": 4 << 20, "segment_pool_id": (1, 7)},
        {"device": 0, "total_size": 8 << 20, "segment_pool_id": (1, 9)},  # another graph pool
        {"device": 1, "total_size": 16 << 20, "segment_pool_id": (1, 7)},  # another GPU
    ]
    backend = object.__new__(graphs.CudaBackend)  # no CUDA here: the fields pool_bytes reads
    backend.pool, backend.device = (1, 7), torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda **kw: snapshot)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **kw: sum(s["total_size"] for s in snapshot))
    assert backend.pool_bytes() == 24 << 20
