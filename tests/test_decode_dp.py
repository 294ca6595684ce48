"""Decode under attention DP (issue 47, docs/parallel.md "Decode under attention DP"): each
replica decodes the requests it prefilled, the MLP and MoE layers over every replica's rows.
Greedy decoding of a batch of mixed lengths over 16 new tokens equals the single-rank engine
(the same ids; every step's logits within 1e-4 in float32; in bfloat16, where a near-tie
may round either way, within the suite's 2e-2 on the reference's sequence), at DP 2 x CP 1
and DP 2 x CP 2, eagerly and on decode graphs (each bucket's first replay self-checked),
with a replica idle (a step of one request) and with replicas of different row counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import rel_err

from graphcp import Conversation, ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import CPGroup, launch
from graphcp.errors import BatchError
from graphcp.runtime.batch import ConsistencyError

LENS = (7, 29, 1)
NEW = 16
TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def greedy(engine: PrefillEngine, force_eager: bool, lens=LENS, forced: torch.Tensor | None = None):
    """A prefill of ``lens``, then NEW - 1 decode steps of the greedy token (``forced``: these
    tokens instead): tokens [R, NEW], logits [R, NEW, V], each step's path; the KV released."""
    rng = np.random.default_rng(3)
    out = engine.prefill([Request(rng.integers(0, engine.cfg.vocab_size, n)) for n in lens], force_eager=True)
    handles, logits, toks, paths = out.handles, [out.last_logits], [out.last_logits.argmax(-1)], []
    for _ in range(NEW - 1):
        o = engine.decode(handles, toks[-1], force_eager=force_eager, logits=True)
        assert np.array_equal(o.tokens, o.logits.argmax(-1).numpy())
        handles, paths = o.handles, paths + [o.info.path]
        logits.append(o.logits)
        toks.append(o.logits.argmax(-1) if forced is None else forced[:, len(toks)])
    for h in handles:
        engine.release(h)
    return torch.stack(toks, 1), torch.stack(logits, 1), paths


def _job(group, folder, dtype, par, modes, batches, forced) -> dict:
    """``modes``: the cache modes, or RuntimeConfig settings by name."""
    out = {}
    for given in modes:
        mode, kw = (given, dict(kv_cache=given)) if isinstance(given, str) else given
        for graph in ("off", "breakable"):
            rt = RuntimeConfig(kv_tokens=512, dtype=dtype, graph=graph, **kw)
            engine = PrefillEngine(folder, rt, group, parallel=par)
            for lens in batches:
                toks, logits, paths = greedy(engine, graph == "off", lens, forced.get(lens))
                checked = [] if engine.parts.runner is None else sorted(engine.parts.decoder.graphs.verified)
                out[mode, graph, lens] = (toks, logits, paths, checked, engine.parts.kv.num_free_pages)
    return out


def _check(folder, dtype, par, modes, batches=(LENS, (13,)), ref_folder=None) -> None:
    ref = {lens: greedy(PrefillEngine(ref_folder or folder, RuntimeConfig(kv_tokens=512, dtype=dtype)), True, lens)
           for lens in batches}
    forced = {} if dtype == "float32" else {lens: r[0] for lens, r in ref.items()}
    free = {}
    for rank, got in enumerate(launch(_job, par.world_size, folder, dtype, par, modes, batches, forced)):
        for (mode, graph, lens), (toks, logits, paths, checked, pages) in got.items():
            where, (want_t, want_l, _) = (rank, mode, graph, lens), ref[lens]
            assert torch.equal(toks, want_t), where  # (bfloat16: fed the reference's)
            assert rel_err(logits, want_l) <= TOL[dtype], (where, rel_err(logits, want_l))
            assert set(paths) == ({"eager"} if graph == "off" else {"graph"}), where
            assert graph == "off" or checked, where  # each bucket's first replay self-checked
            assert free.setdefault((rank, mode, graph), pages) == pages, where  # every page given back


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return {dtype: hf_model_dir("qwen3", False, dtype) for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dp2_cp1_decode_equals_one_rank(folders, dtype):
    _check(folders[dtype], dtype, ParallelConfig(tp_size=2, dp_size=2, cp_size=1), ("replicated",))


def test_dp2_cp2_decode_equals_one_rank(folders):
    """``--tp 4 --dp 2 --cp 2``: each replica's step merged over its own CP group."""
    _check(folders["float32"], "float32", ParallelConfig(tp_size=4, dp_size=2, cp_size=2), ("sharded", "layer-split"))


def test_moe_dp2_decode_equals_one_rank(hf_model_dir):
    """A MoE model's experts over both replicas' rows: ``ep`` (each rank dispatches a slice
    of its replica's rows) and ``tp`` (every replica's rows gathered over DP)."""
    folder = hf_model_dir("qwen3_moe")
    _check(folder, "float32", ParallelConfig(tp_size=2, dp_size=2, cp_size=1),
           (("ep", {"moe": "ep"}), ("tp", {"moe": "tp"})))


@pytest.mark.parametrize("family,dtype,cp,mode", [
    ("deepseek_v32", "float32", 1, "replicated"), ("deepseek_v32", "float32", 2, "layer-split"),
    ("glm_moe_dsa", "float32", 2, "layer-split"), ("deepseek_v32", "bfloat16", 2, "layer-split")])
def test_dsa_prefill_and_decode_under_attention_dp(hf_model_dir, family, dtype, cp, mode):
    """A DSA model's replicas each prefill and decode their requests over their own latent and
    indexer-key caches (the first logits are the prefill's); GLM-5's shared indexer layer too.
    bfloat16 on the twin whose indexer selects every token (a top-k near-tie would flip with
    the FFN's summation order over the replicas)."""
    twin = {} if dtype == "float32" else dict(index_topk=64)
    _check(hf_model_dir(family, False, dtype, **twin), dtype, ParallelConfig(tp_size=2 * cp, dp_size=2, cp_size=cp),
           (mode,))


def _refusals(group, folder) -> list[str]:
    engine = PrefillEngine(folder, RuntimeConfig(kv_tokens=512), group,
                           parallel=ParallelConfig(tp_size=2, dp_size=2, cp_size=1))
    out = engine.prefill([Request([1, 2, 3, 4]), Request([5, 6])])
    assert sorted(h.replica for h in out.handles) == [0, 1]
    errors = []
    for tokens in ([7, 512], [7, 8]):  # a token outside the vocabulary; then a handle released on its replica
        if tokens == [7, 8]:
            engine.release(out.handles[0])
        snap = engine.parts.kv.snapshot()
        with pytest.raises(BatchError) as e:
            engine.decode(out.handles, tokens)
        assert engine.parts.kv.snapshot() == snap and "\n" not in str(e.value)
        errors.append(str(e.value))
    engine.release(out.handles[1])
    return errors


def test_a_refusal_on_one_replica_is_raised_on_every_rank(folders):
    """Bad input is one line on every rank, nothing changed: a refusal every rank sees, and
    one only the replica holding the request sees (the other says another replica refused)."""
    errors = launch(_refusals, 2, folders["float32"])
    for errs in errors:
        assert "token id 512 is outside the vocabulary" in errs[0]
    released = sorted(errs[1] for errs in errors)
    assert "another attention-DP replica refused" in released[0] and "request 0" in released[1], released


@pytest.mark.parametrize("family", ["qwen3_5_text", "deepseek_v4"])
def test_a_hybrid_and_deepseek_v4_decode_under_attention_dp(hf_model_dir, family):
    """A hybrid's states and V4's window and entries on the replica holding the request
    (V4's own attention plans only its replica's requests), a replica idle in the second batch."""
    _check(hf_model_dir(family), "float32", ParallelConfig(tp_size=2, dp_size=2, cp_size=1), ("replicated",))


def _generate(group, folder, stop):
    engine = PrefillEngine(folder, RuntimeConfig(kv_tokens=512, graph="breakable"), group,
                           parallel=None if group.size == 1 else ParallelConfig(tp_size=2, dp_size=2, cp_size=1))
    free = engine.parts.kv.num_free_pages
    got = engine.generate([[5, 9, 200, 7], Conversation([[3, 4], [7, 8, 9]], max_new_tokens=5), [11] * 9],
                          max_new_tokens=8, stop=stop)
    assert engine.parts.kv.num_free_pages == free  # every page given back
    return got.tokens, got.finish


def test_generate_under_attention_dp_equals_one_rank(folders):
    """Conversations and a stop token: requests finish at different steps, a replica
    sometimes idle; the same tokens as one rank."""
    folder = folders["float32"]
    want = _generate(CPGroup(), folder, None)
    stop = [want[0][0][0][3]]  # the first request stops at its fourth token
    want = _generate(CPGroup(), folder, stop)
    assert want[1][0] == ["stop"] and len(want[0][0][0]) == 4, want
    for got in launch(_generate, 2, folder, stop):
        assert got == want


def _different_steps(group, folder) -> str:
    engine = PrefillEngine(folder, RuntimeConfig(kv_tokens=512), group,
                           parallel=ParallelConfig(tp_size=2, dp_size=2, cp_size=1))
    out = engine.prefill([Request([1, 2, 3, 4]), Request([5, 6])])
    snap = engine.parts.kv.snapshot()
    with pytest.raises(ConsistencyError) as e:  # the replicas given different tokens
        engine.decode(out.handles, [7, 8 + group.rank])
    assert engine.parts.kv.snapshot() == snap
    return str(e.value)


def test_replicas_given_different_steps_raise_on_every_rank(folders):
    for msg in launch(_different_steps, 2, folders["float32"]):
        assert "every rank must call decode with the same" in msg and "\n" not in msg, msg


PP_DP = ParallelConfig(tp_size=2, dp_size=2, cp_size=1, pp_size=2)  # 2 stages x 2 replicas: 4 ranks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dp2_under_pp2_decode_equals_one_rank(folders, dtype):
    """Attention DP under pipeline stages: each stage's replica d hands its rows to the next
    stage's replica d; every replica's next tokens reach every rank from the last stage (a
    replica idle in the second batch)."""
    _check(folders[dtype], dtype, PP_DP, ("replicated",))


def _prefill_outputs(group, folder, dtype) -> list[torch.Tensor]:
    """A batch's last and every token's logits and two layers' hidden states (one a stage),
    then a second turn extending the first request's cached prefix."""
    one = group.size == 1
    engine = PrefillEngine(folder, RuntimeConfig(kv_tokens=512, dtype=dtype, graph="off"), group,
                           parallel=None if one else PP_DP)
    rng = np.random.default_rng(5)
    reqs = [Request(rng.integers(0, 512, n)) for n in (9, 30, 2)]
    first = engine.prefill(reqs, all_logits=True, aux_hidden_layers=[1, 0])
    nxt = engine.prefill([Request([3, 4, 5], first.handles[1])], all_logits=True, aux_hidden_layers=[0])
    got = [first.last_logits, torch.cat(first.logits), torch.cat(first.aux_hidden), nxt.last_logits,
           torch.cat(nxt.logits), torch.cat(nxt.aux_hidden)]
    if not one:
        assert {h.replica for h in first.handles} == {0, 1} and nxt.handles[0].replica == \
            first.handles[1].replica
    return got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dp2_under_pp2_prefill_outputs_equal_one_rank(folders, dtype):
    """Every output of a prefill under DP x PP (the logits from the last stage, each stage's
    own auxiliary layer) on every rank, and a cached prefix extended on its replica."""
    want = _prefill_outputs(CPGroup(), folders[dtype], dtype)
    for rank, got in enumerate(launch(_prefill_outputs, 4, folders[dtype], dtype)):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert rel_err(a, b) <= TOL[dtype], (rank, i, rel_err(a, b))
