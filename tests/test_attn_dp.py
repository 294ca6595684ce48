"""Attention DP (ParallelConfig.dp_size > 1): a batch's requests split over the
replicas, deterministic and balanced by causal work; each replica prefills its own
requests with its own KV cache while the MLP / MoE run over every rank; every rank
returns the whole batch in request order, equal to one rank's run (float32 1e-5,
bfloat16 2e-2); a prefix extends on the replica that holds it; a batch with fewer
requests than replicas runs (the idle replica pads) without a hang."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import mesh_engine, rel_err, twin_of

from graphcp import (
    BatchError,
    ConfigError,
    ConsistencyError,
    ParallelConfig,
    PrefillEngine,
    Request,
    RuntimeConfig,
)
from graphcp.dist import launch
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.dp import ReplicaHandle, assign_replicas, causal_work
from graphcp.runtime.engine import prefill_after_prefixes

LENS = [37, 1, 6, 20, 11]
PREFIX = [0, 0, 13, 4, 0]
AUX = (1,)
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
BUCKETS = BucketSet((16, 32, 64), padding_factor=64.0)
#: (tp, cp, dp, family, dtype, layout, kv_cache, graph, moe)
CASES = [
    (4, 2, 2, "qwen3", "float32", "zigzag", "replicated", "off", "ep"),
    (4, 2, 2, "qwen3", "bfloat16", "zigzag", "sharded", "breakable", "ep"),
    (4, 2, 2, "qwen3", "float32", "interleave", "layer-split", "breakable", "ep"),
    (4, 1, 2, "qwen3", "float32", "zigzag", "replicated", "breakable", "ep"),  # attention TP 2 in each replica
    (4, 2, 2, "qwen3_moe", "float32", "zigzag", "replicated", "breakable", "ep"),
    (4, 1, 2, "qwen3_moe", "bfloat16", "interleave", "replicated", "off", "tp"),
    (4, 2, 2, "qwen3", "float32", "zigzag", "replicated", "full", "ep"),  # attention captured too (triton)
]


def _batch(vocab: int):
    rng = np.random.default_rng(9)
    return [(rng.integers(0, vocab, p) if p else None, rng.integers(0, vocab, n)) for n, p in zip(LENS, PREFIX)]


def _run(eng):
    """The mixed batch (prefixes first, then the new tokens extending them) and a batch
    of one request (fewer than the replicas)."""
    out = prefill_after_prefixes(eng, _batch(eng.cfg.vocab_size), all_logits=True, aux_hidden_layers=AUX)
    one = eng.prefill([Request(np.arange(9) % eng.cfg.vocab_size)], all_logits=True)
    for h in out.handles + one.handles:
        eng.release(h)
    return out, one


def _job(group, folders, cases):
    res = []
    for tp, cp, dp, *case in cases:
        eng = mesh_engine(group, folders, BUCKETS, ParallelConfig(tp_size=tp, cp_size=cp, dp_size=dp), *case, AUX)
        out, one = _run(eng)
        assert all(isinstance(h, ReplicaHandle) for h in out.handles)
        assert eng.parts.kv.stored_tokens() == 0  # every handle released, the padding request's pages given back
        res.append((out.last_logits, out.logits, out.aux_hidden, out.info.path, out.info.stats["dp_assignment"],
                    [h.replica for h in out.handles], one.last_logits, one.logits, eng.stats()["mesh"]))
    return res


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return {"qwen3": hf_model_dir("qwen3"), "qwen3_moe": hf_model_dir("qwen3_moe"),
            "qwen3_moe-all": hf_model_dir("qwen3_moe", num_experts_per_tok=8)}


@pytest.fixture(scope="module")
def results(folders):
    return launch(_job, 4, folders, CASES, timeout_s=300)


@pytest.fixture(scope="module")
def single(folders):
    out = {}
    for family in ("qwen3", "qwen3_moe"):
        for dtype in TOL:
            o, one = _run(PrefillEngine(folders[twin_of(family, dtype)],
                                        RuntimeConfig(dtype=dtype, kv_tokens=1024, aux_hidden_layers=AUX)))
            out[family, dtype] = (o.last_logits, o.logits, o.aux_hidden, one.last_logits, one.logits)
    return out


def test_attention_dp_equals_a_single_rank(results, single):
    want_where = assign_replicas(LENS, PREFIX, [None] * len(LENS), 2)
    for case, rank_results in zip(CASES, zip(*results)):
        tp, cp, dp, family, dtype, *_, graph, _ = case
        rlast, rlogits, raux, rone, rone_logits = single[family, dtype]
        for rank, (last, logits, aux, path, where, replicas, one, one_logits, mesh) in enumerate(rank_results):
            assert path == ("eager" if graph == "off" else "graph"), case
            # every request extended its prefix on the replica that held it (the prefixes' own
            # forward assigned them): the final handles name the same replicas on every rank
            assert replicas == rank_results[0][5] and len(set(replicas)) == 2, (case, replicas)
            assert where == replicas
            assert rel_err(last, rlast) <= TOL[dtype], (case, rank, rel_err(last, rlast))
            for a, b in zip(logits, rlogits):
                assert rel_err(a, b) <= TOL[dtype], (case, rank)
            for a, b in zip(aux, raux):
                assert rel_err(a, b) <= TOL[dtype], (case, rank)
            assert rel_err(one, rone) <= TOL[dtype] and rel_err(one_logits[0], rone_logits[0]) <= TOL[dtype]
            A = tp // (cp * dp)
            assert mesh == {"stage": 0, "dp": rank // (cp * A), "cp": rank // A % cp, "attn_tp": rank % A}
        for other in rank_results[1:]:
            assert torch.equal(other[0], rank_results[0][0]), case
    assert want_where == assign_replicas(LENS, PREFIX, [None] * len(LENS), 2)  # deterministic


def test_assignment_is_balanced_and_keeps_prefixes_home():
    rng = np.random.default_rng(0)
    new = [int(x) for x in rng.integers(1, 4000, 64)] + [1, 1, 2]
    cached = [int(x) for x in rng.integers(0, 2000, 67)]
    for replicas in (2, 4):
        where = assign_replicas(new, cached, [None] * len(new), replicas)
        load = np.zeros(replicas)
        for i, d in enumerate(where):
            load[d] += causal_work(new[i], cached[i])
        assert load.max() / load.mean() <= 1.1, (replicas, load)
        assert where == assign_replicas(new, cached, [None] * len(new), replicas)
    fixed = [1, None, 0, None]
    where = assign_replicas([5, 5, 5, 5], [3, 0, 3, 0], fixed, 2)
    assert where[0] == 1 and where[2] == 0


def _refusals(group, folder):
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=512), group,
                        parallel=ParallelConfig(tp_size=2, cp_size=1, dp_size=2))
    out = eng.prefill([Request([1, 2, 3]), Request([4, 5])])
    errors = []
    for call in (lambda: eng.export_kv(ReplicaHandle(5, 3)), lambda: eng.prefill([Request([1])], microbatches=2),
                 lambda: eng.prefill([Request([1], prefix=out.handles[0].local or out.handles[1].local)]),
                 lambda: eng.prefill([Request([1]), Request([2] * 5000)]),
                 # the replicas given different batches (one token differs): both ranks' share goes to
                 # replica 0, so without a check over the whole mesh replica 1 would pad and say nothing
                 lambda: eng.prefill([Request([1, 2, 3 + group.rank])])):
        try:
            call()
        except (ConfigError, BatchError, ConsistencyError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    after = eng.prefill([Request([7, 8])])  # the refusals changed nothing; the engine still runs
    return errors, eng.parts.kv.stored_tokens(), after.last_logits


def test_dp_refuses_what_is_not_built_and_agrees_on_a_refused_batch(hf_model_dir):
    """A handle of no replica is refused by the export, micro-batches under DP; a plain cache handle is not a
    DP prefix; a request one replica refuses (longer than the context) is refused on
    every rank (the other replica's ranks agree before any forward: no hang); ranks of
    different replicas given different batches get a one-line ConsistencyError each."""
    results = launch(_refusals, 2, hf_model_dir("qwen3"), timeout_s=120)
    for rank, (errors, _, _) in enumerate(results):
        assert len(errors) == 5, errors
        assert "KVHandleError: a ReplicaHandle of replica 5: this engine has 2 attention-DP replicas" in errors[0]
        assert "microbatches=2 under attention DP is not built yet" in errors[1]
        assert "under attention DP a prefix is the ReplicaHandle" in errors[2]
        assert "exceed" in errors[3] or "another attention-DP replica refused" in errors[3]
        assert errors[4].startswith(f"ConsistencyError: rank {rank}: ranks [{1 - rank}] were given a different "
                                    "batch") and "\n" not in errors[4], errors[4]
    # each replica's cache holds its own requests: replica 0 the 3 tokens of the first batch's
    # request 0 and the last batch's 2 (the lower index wins a tie), replica 1 request 1's 2
    assert [stored for _, stored, _ in results] == [5, 2]
    assert torch.equal(results[0][2], results[1][2])


#: replica 0 gets the 20-token request, replica 1 the five 1-token ones: more segments than a
#: full graph's static metadata holds at max_requests=2, so replica 1 alone cannot replay
FALLBACK_LENS = [20, 1, 1, 1, 1, 1]


def _full_graph_fallback(group, folder):
    """Per dtype: the batch one replica cannot replay (every replica must then run eagerly
    at the same rows, or the FFN's collectives differ in size: gloo aborted, NCCL would
    hang), and a batch both replicas replay."""
    out = {}
    for dtype in TOL:
        rt = RuntimeConfig(dtype=dtype, graph="full", attention="triton", kv_tokens=512, max_requests=2)
        eng = PrefillEngine(folder, rt, group, BucketSet((16, 32), padding_factor=64.0),
                            ParallelConfig(tp_size=2, cp_size=1, dp_size=2))
        eng.capture()
        stage, agreements = eng.parts.mesh.ffn, []  # the object the replicas agree over
        reduce, gather = stage.all_reduce_, stage.all_gather_rows
        # the stage's agreements
        stage.all_reduce_ = lambda x, op="sum": (agreements.append(f"all_reduce {op}"), reduce(x, op))[1]
        stage.all_gather_rows = lambda x: (agreements.append("all_gather"), gather(x))[1]
        got = []
        for lens in (FALLBACK_LENS, [20, 1]):
            agreements.clear()
            res = eng.prefill([Request(np.arange(n) * 7 % eng.cfg.vocab_size + 3) for n in lens], all_logits=True)
            got.append((res.info.path, res.info.fallback, res.logits, list(agreements)))
            for h in res.handles:
                eng.release(h)
        out[dtype] = got
    return out


def test_full_graph_fallback_is_agreed_by_every_replica(hf_model_dir):
    """Attention DP with graph='full': the eager fallback is decided with the rows, on
    every rank, so both replicas take the same path; the logits equal one rank's in
    float32 and bfloat16. The batch's fingerprint, the refusal, the rows and the fallback
    are one all-gather over the stage a forward (one host sync; there were two)."""
    from graphcp.runtime.capture.buckets import FALLBACK_REQUESTS

    folder = hf_model_dir("qwen3")
    results = launch(_full_graph_fallback, 2, folder, timeout_s=300)
    for dtype in TOL:
        ref = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=512))
        for k, lens in enumerate((FALLBACK_LENS, [20, 1])):
            want = ref.prefill([Request(np.arange(n) * 7 % ref.cfg.vocab_size + 3) for n in lens], all_logits=True)
            for h in want.handles:
                ref.release(h)
            for rank, per_dtype in enumerate(results):
                path, fallback, logits, agreements = per_dtype[dtype][k]
                assert (path, fallback) == (("eager", FALLBACK_REQUESTS) if k == 0 else ("graph", None)), (rank, k)
                assert agreements == ["all_gather"], agreements
                for a, b in zip(logits, want.logits):
                    assert rel_err(a, b) <= TOL[dtype], (dtype, rank, k, rel_err(a, b))
