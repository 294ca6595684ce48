"""Decode composed with the mesh, and what it refuses (issue 40, docs/decode.md).

Attention TP 2 inside CP 2 (4 ranks): each rank attends and merges its own heads over its
share of the KV, and the steps match the single-rank engine, on the token-sharded and
the replicated cache. (The other compositions, MoE ep and tp, both prefill layouts,
full and breakable graphs, aux, export after decoding, are runs of the combination
matrix: tests/test_combinations.py.) What decode does not combine with (pipeline stages,
attention DP, an EAGLE-3 draft) is one ConfigError line from
``decode`` and ``generate``, before anything runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eagle3_ref import draft_config, draft_tensors, write_draft
from helpers import rel_err

from graphcp import ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.combinations import REFUSALS
from graphcp.dist import launch
from graphcp.errors import ConfigError

STEPS = 4


def _greedy(engine: PrefillEngine) -> tuple[list, list]:
    """A prefill of two requests, then STEPS decode steps of fixed tokens: every step's logits."""
    rng = np.random.default_rng(2)
    out = engine.prefill([Request(rng.integers(0, 512, 19)), Request(rng.integers(0, 512, 3))])
    handles, logits = out.handles, [out.last_logits]
    for i in range(STEPS):
        step = engine.decode(handles, [i + 1, 2 * i + 5], logits=True)
        handles = step.handles
        logits.append(step.logits)
    merges = {s["decode_merge"] for s in engine.stats()["decode_steps"]}
    for h in handles:
        engine.release(h)
    return logits, sorted(merges)


def _mesh_job(group, folder) -> dict:
    par = ParallelConfig(cp_size=2, tp_size=4)  # attention TP 2 in each CP partition
    return {mode: _greedy(PrefillEngine(folder, RuntimeConfig(kv_tokens=512, kv_cache=mode), group, parallel=par))
            for mode in ("sharded", "replicated")}


@pytest.fixture(scope="module")
def folder(hf_model_dir):
    return hf_model_dir("qwen3", False, "float32")


def test_attention_tp_ranks_merge_their_own_heads(folder):
    ref, _ = _greedy(PrefillEngine(folder, RuntimeConfig(kv_tokens=512)))
    for rank, got in enumerate(launch(_mesh_job, 4, folder)):
        for mode, (logits, merges) in got.items():
            # 2 rows of 2 heads (this rank's) over 2 ranks: the all-to-all moves 520 bytes a layer, the all-gather 528
            assert merges == (["all-to-all"] if mode == "sharded" else ["local"]), (rank, mode)
            for i, (a, b) in enumerate(zip(logits, ref, strict=True)):
                assert rel_err(a, b) <= 1e-5, (rank, mode, i)


def _refused(engine: PrefillEngine, pair: tuple[str, str]) -> None:
    rule = next(r for r in REFUSALS if {r.a[0], r.b[0]} == {pair[0], "decode"} and pair[1] in r.a[1] + r.b[1])
    out = engine.prefill([Request([1, 2, 3])])
    for name, call in (("PrefillEngine.decode", lambda: engine.decode(out.handles, [4])),
                       ("PrefillEngine.generate", lambda: engine.generate([[1, 2]], 3))):
        snap = engine.parts.kv.snapshot()
        with pytest.raises(ConfigError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and name in msg and rule.reason in msg, msg
        assert engine.parts.kv.snapshot() == snap


def _mesh_refusals(group, folder) -> bool:
    for par, pair in ((ParallelConfig(cp_size=1, pp_size=2), ("pp", ">1")),
                      (ParallelConfig(cp_size=1, dp_size=2), ("dp", ">1"))):
        _refused(PrefillEngine(folder, RuntimeConfig(kv_tokens=256), group, parallel=par), pair)
    return True


def test_pipeline_stages_and_attention_dp_refuse_decode(folder):
    assert all(launch(_mesh_refusals, 2, folder))


def test_an_engine_with_a_draft_decodes_as_one_without(folder, tmp_path):
    """A plain step on an engine with a draft (speculative decoding: tests/test_speculative.py)
    gives the same logits, and a next turn extends the decoded tokens (the draft's K/V of a
    plain step's token stays unwritten: the draft no longer holds a next token for it)."""
    draft = write_draft(tmp_path / "draft", draft_tensors(head_dim=32),
                        draft_config(head_dim=32, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 0, 1]}))
    got = []
    for d in (str(draft), None):
        eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=256, graph="off", draft=d))
        out = eng.prefill([Request([5, 9, 200, 7])])
        step = eng.decode(out.handles, [11], logits=True)
        nxt = eng.prefill([Request([12, 13], step.handles[0])])
        got.append((step.logits, nxt.last_logits))
        eng.release(nxt.handles[0])
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    # (DSA and DeepSeek V4 models decode: tests/test_dsa_decode.py, tests/test_dsv4_decode.py)
