"""Decode graphs (issue 40, docs/decode.md): one per batch-size bucket, attention and merge
inside. On the CPU stand-in (the ``trace`` graph backend) a replay must equal bitwise the
same step run eagerly on the same bucket (its hidden rows and the K/V it writes), at CP 2
over each cache mode and a MoE ``ep`` model (whose exchange stays a break); a dense step is
one launch; a step larger than every bucket runs eagerly and says why."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cp_utils import rel_err

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.dist import CPGroup, launch

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
CASES = [("qwen3", "replicated"), ("qwen3", "sharded"), ("qwen3", "layer-split"), ("qwen3_moe", "sharded")]


def _same_bucket(engine: PrefillEngine, lens, tokens) -> dict:
    """A prepared step replayed on its bucket, then the same step run eagerly on the same
    bucket from the same cache: the hidden rows and the pool after each, the launches."""
    out = engine.prefill([Request(np.arange(n) % 500 + 1) for n in lens])
    dec = engine.parts.decoder
    step = dec.preparer.prepare(out.handles, tokens)
    try:
        pool0 = engine.parts.kv.pool.clone()
        hidden, info = engine.parts.runner.try_replay(step)
        bucket, launches, stats = info.bucket, info.launches, {"decode_merge": step.kv_plan}
        got = (hidden.clone(), engine.parts.kv.pool.clone())
        engine.parts.kv.pool.copy_(pool0)
        want = (engine.parts.runner.eager_on_bucket(step, bucket)[: len(lens)].clone(), engine.parts.kv.pool.clone())
    finally:
        dec.preparer.abort(step)
    for h in out.handles:
        engine.release(h)
    return {"bitwise": all(torch.equal(a, b) for a, b in zip(got, want)), "bucket": bucket, "launches": launches,
            "merge": stats["decode_merge"], "wrote": int((got[1][:, 1:] != pool0[:, 1:]).sum())}  # (not scratch)


def _job(group, folders: dict) -> list[dict]:
    res = []
    for family, mode in CASES:
        rt = RuntimeConfig(kv_tokens=512, kv_cache=mode, graph="breakable", page_size=16)
        res.append(_same_bucket(PrefillEngine(folders[family], rt, group), [5, 33, 1], [7, 8, 9]))
    return res


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return {f: hf_model_dir(f, False, "float32") for f in ("qwen3", "qwen3_moe")}


def test_a_replay_equals_the_same_bucket_eager_step_bitwise(folders):
    ranks = launch(_job, 2, folders)
    for rank, results in enumerate(ranks):
        for k, ((family, mode), r) in enumerate(zip(CASES, results)):
            where = (rank, family, mode)
            assert r["bitwise"] and r["bucket"] == 4, where
            # every rank writes the new tokens' K/V, or (sharded) each token's one rank
            assert (r["wrote"] > 0 if mode != "sharded" else sum(x[k]["wrote"] for x in ranks) > 0), where
            # a dense body is one segment; the MoE model's ep layer (layer 0) stays a break
            assert r["launches"] == (3 if family == "qwen3_moe" else 1), (where, r["launches"])
            assert r["merge"] == ("all-to-all" if mode == "sharded" else "local"), where


def _triton_job(group, folder: str, dtype: str, modes: tuple[str, ...]) -> list[dict]:
    from graphcp.attention.backends.triton_decode import TritonDecodeAttention

    res = []
    for mode in modes:
        rt = RuntimeConfig(kv_tokens=512, kv_cache=mode, graph="breakable", page_size=16, attention="triton",
                           dtype=dtype)
        engine = PrefillEngine(folder, rt, group)
        assert isinstance(engine.parts.decoder.graphs.kernel, TritonDecodeAttention)
        r = _same_bucket(engine, [5, 33, 1], [7, 8, 9])
        ref = PrefillEngine(folder, RuntimeConfig(kv_tokens=512, kv_cache=mode, graph="off", page_size=16,
                                                  dtype=dtype), group)
        lens = [5, 33, 1]
        want = ref.decode(ref.prefill([Request(np.arange(n) % 500 + 1) for n in lens]).handles, [7, 8, 9],
                          logits=True)
        got = engine.decode(engine.prefill([Request(np.arange(n) % 500 + 1) for n in lens]).handles, [7, 8, 9],
                            logits=True)
        res.append(dict(r, path=got.info.path, err=rel_err(got.logits, want.logits)))
    return res


@pytest.mark.parametrize("dtype,modes", [
    ("float32", ("sharded",)),
    pytest.param("float32", ("replicated",), marks=pytest.mark.slow),
    pytest.param("bfloat16", ("replicated", "sharded"), marks=pytest.mark.slow),
])
def test_the_triton_decode_kernel_replays_bitwise_against_the_same_bucket_eager_step(folders, hf_model_dir, dtype,
                                                                                       modes):
    """The engine's ``triton`` backend: its decode graphs capture the Triton decode kernel
    (interpreted here); at CP 2 over a token-sharded cache (whose ranks merge by the
    kernel's LSE) and a replicated one, a replay equals the same-bucket eager step
    bitwise, and a graph step equals the torch backend's eager engine within the dtype's
    tolerance (the interpreter makes each run a minute: the default run has one)."""
    folder = folders["qwen3"] if dtype == "float32" else hf_model_dir("qwen3", False, dtype)
    for rank, results in enumerate(launch(_triton_job, 2, folder, dtype, modes)):
        for mode, r in zip(modes, results):
            assert r["bitwise"] and r["bucket"] == 4 and r["path"] == "graph", (rank, mode)
            assert r["err"] <= TOL[dtype], (rank, mode, r["err"])


def test_a_step_larger_than_every_bucket_runs_eagerly_and_says_so(folders):
    rt = RuntimeConfig(kv_tokens=512, graph="breakable", decode_buckets=(1, 2))
    engine = PrefillEngine(folders["qwen3"], rt)
    out = engine.prefill([Request([1, 2, 3]), Request([4]), Request([5, 6])])
    try:
        small = engine.decode(out.handles[:2], [1, 2])
        big = engine.decode([small.handles[0], small.handles[1], out.handles[2]], [3, 4, 5])
        eager = engine.decode(big.handles[:1], [6], force_eager=True)
        assert (small.info.path, small.info.bucket) == ("graph", 2)
        assert (big.info.path, big.info.fallback) == ("eager", "larger_than_every_bucket")
        assert (eager.info.path, eager.info.fallback) == ("eager", None)
        steps = engine.stats()["decode_steps"][-3:]
        assert [s["fallback"] for s in steps] == [None, "larger_than_every_bucket", None]
        assert engine.parts.decoder.graphs.fallbacks["larger_than_every_bucket"] == 1
        assert small.info.stats["pages"] == 1  # the requests' one page: the smallest page bucket
        assert engine.capture_decode(pages=1) == [1]  # the batch sizes not captured yet for one page
        assert engine.capture_decode() == [2, 1]  # nor for the widest
    finally:
        for h in (eager.handles[0], *big.handles[1:]):
            engine.release(h)


def test_the_page_bucket_holds_the_longest_share_within_twice():
    from graphcp.runtime.capture.phases import page_bucket

    assert [page_bucket(p, 32) for p in (0, 1, 2, 3, 5, 16, 17, 32, 40)] == [1, 1, 2, 4, 8, 16, 32, 32, 32]


def _corrupt_first_replay(engine: PrefillEngine, rank: int) -> None:
    """Make every bucket captured on ``rank`` replay one value differently from eager
    (what a graph that kept something of its capture batch would do)."""
    graphs, capture = engine.parts.decoder.graphs, engine.parts.runner.capture_bucket

    def corrupted(key, phase):
        captured = capture(key, phase)
        if engine.world_rank == rank:
            graph = graphs.graphs[key].graph
            replay = graph.replay
            graph.replay = lambda ctx: (replay(ctx), graphs.buffers.hidden_out[1, 0].add_(1.0))
        return captured

    engine.parts.runner.capture_bucket = corrupted


def _self_check_job(group, folder: str, dtype: str, corrupt_rank: int | None) -> dict:
    from graphcp.runtime.capture.graphs import CaptureError

    engine = PrefillEngine(folder, RuntimeConfig(kv_tokens=512, graph="breakable", page_size=16, dtype=dtype,
                                                 kv_cache="sharded" if group.size > 1 else "replicated"), group)
    out = engine.prefill([Request(np.arange(n) % 500 + 1) for n in (5, 33, 1)])
    if corrupt_rank is not None:
        _corrupt_first_replay(engine, corrupt_rank)
    pool0 = engine.parts.kv.pool.clone()
    try:
        step = engine.decode(out.handles, [7, 8, 9], logits=True)
    except CaptureError as e:
        # refused whole: the cache as before, and the same step then runs eagerly
        same_pool = torch.equal(engine.parts.kv.pool, pool0)
        eager = engine.decode(out.handles, [7, 8, 9], force_eager=True, logits=True)
        return {"error": str(e), "same_pool": same_pool, "eager": eager.logits}
    eager_engine = PrefillEngine(folder, RuntimeConfig(kv_tokens=512, graph="off", page_size=16, dtype=dtype,
                                                       kv_cache="sharded" if group.size > 1 else "replicated"), group)
    ref = eager_engine.decode(eager_engine.prefill([Request(np.arange(n) % 500 + 1) for n in (5, 33, 1)]).handles,
                              [7, 8, 9], logits=True)
    return {"path": step.info.path, "verified": sorted(engine.parts.decoder.graphs.verified), "logits": step.logits,
            "eager": ref.logits}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_first_replay_of_a_bucket_is_checked_against_the_eager_step(folders, dtype):
    """On the CPU stand-in each bucket's first replay is compared bitwise with the same
    step run eagerly on the bucket; a checked step equals an engine without graphs."""
    r = _self_check_job(CPGroup(), folders["qwen3"], dtype, None)
    assert r["path"] == "graph" and r["verified"] == [(4, 4)]
    assert torch.equal(r["logits"], r["eager"]) or rel_err(r["logits"], r["eager"]) <= TOL[dtype]


def test_a_replay_that_differs_stops_the_step_on_every_rank_and_changes_nothing(folders):
    """A corrupted replay on rank 0 at CP 2: both ranks raise (none is left in a
    collective), the cache is as before, and the same step then runs eagerly."""
    ranks = launch(_self_check_job, 2, folders["qwen3"], "float32", 0)
    assert "decode graph self-check of bucket 4 requests x 2 pages" in ranks[0]["error"]
    assert "hidden_out rows [1]" in ranks[0]["error"], ranks[0]["error"]
    assert "another rank's output differs" in ranks[1]["error"]
    assert all(r["same_pool"] for r in ranks)
    assert torch.equal(ranks[0]["eager"], ranks[1]["eager"])


def test_a_fill_waits_for_the_previous_fills_uploads_before_rewriting_its_host_buffers(folders):
    """On a GPU the step's rows reach the static buffers by non-blocking uploads from
    pinned memory, read when the stream runs them. With a copy engine that runs them late
    (tests/fake_copy_engine.py, which refuses a strided host source: torch would copy it
    to pageable memory first), a replay queued after each fill reads its own step's rows:
    each fill waited for the previous one's uploads before rewriting, on the largest
    bucket and on a smaller one (whose rows are a prefix of the buffers)."""
    from fake_copy_engine import FakeCopyEngine

    from graphcp.runtime.capture.phases import DecodeGraphs

    engine = PrefillEngine(folders["qwen3"], RuntimeConfig(kv_tokens=512, graph="breakable", page_size=16))
    out = engine.prefill([Request(np.arange(n) % 500 + 1) for n in (5, 33, 1)])
    copies = FakeCopyEngine()
    graphs = DecodeGraphs(engine.parts.body, (2, 4), staging=copies)
    seen = []
    for tokens in ([7, 8, 9], [10, 11, 12], [13, 14]):
        cap = 2 if len(tokens) == 2 else 4
        step = engine.parts.decoder.preparer.prepare(out.handles[: len(tokens)], tokens)
        try:
            view = graphs.fill(step, (cap, graphs.pages(step)))
            copies.launch(lambda view=view: seen.append((view.input_ids.tolist(), view.kv_lens.tolist(),
                                                         view.positions.tolist(), view.kv_slots.tolist())))
        finally:
            engine.parts.decoder.preparer.abort(step)
    copies.sync()
    assert [ids for ids, *_ in seen] == [[7, 8, 9, 0], [10, 11, 12, 0], [13, 14]]
    assert seen[0][1] == seen[1][1] and seen[0][1][3] == 0 and min(seen[0][1][:3]) > 0  # lengths; inert row 0
    assert seen[2][1] == seen[0][1][:2] and seen[2][2] == seen[0][2][:2] == [5, 33]  # positions: the lengths
    assert seen[0][3][3] == -1 and min(seen[2][3]) >= 0  # an inert row's slot: -1
    assert copies.waits == 2
