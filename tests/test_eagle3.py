"""EAGLE-3 draft prefill under CP (docs/speculative.md): the draft's logits at every new
position equal a plain-torch EAGLE-3 reference (tests/eagle3_ref.py) fed transformers'
hidden states of the target, at CP 1, 2 and 4, zigzag and interleave, graphs off and
breakable, every cache mode, with cached prefixes (whose draft K/V the earlier forward
wrote), float32 and bfloat16; a shift made after sharding fails it; the stats show no
hidden-state exchange; the refusals are one-line errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from eagle3_ref import LAYER_IDS, eagle3_reference, shifted, target_states, write_draft, write_target
from helpers import rel_err

import graphcp.runtime.draft as draft_runtime
from graphcp import BatchError, ConfigError, ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import CPGroup, launch
from graphcp.model.eagle3.shift import draft_input_ids
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import prefill_after_prefixes

LENS = [37, 1, 9, 20]
PREFIX = [0, 0, 13, 5]
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
BUCKETS = BucketSet((16, 32, 64, 128), padding_factor=64.0)
KV_ROW = 2 * 2 * 16  # K and V, 2 KV heads of 16
#: (cp, layout, graph, dtype, kv_cache) per launch size
CASES = {
    1: [(1, "zigzag", "off", "float32", "replicated"), (1, "interleave", "breakable", "bfloat16", "replicated")],
    2: [(2, "zigzag", "off", "float32", "replicated"), (2, "interleave", "off", "float32", "layer-split"),
        (2, "zigzag", "breakable", "float32", "sharded"), (2, "interleave", "breakable", "bfloat16", "replicated"),
        (2, "zigzag", "off", "bfloat16", "sharded"), (2, "zigzag", "breakable", "float32", "layer-split")],
    4: [(4, "zigzag", "breakable", "float32", "replicated"), (4, "interleave", "off", "float32", "layer-split"),
        (4, "zigzag", "off", "bfloat16", "sharded")],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    return str(write_target(root / "target")), str(write_draft(root / "draft"))


def _batch():
    rng = np.random.default_rng(7)
    return [(rng.integers(0, 512, p) if p else None, rng.integers(0, 512, n)) for n, p in zip(LENS, PREFIX)]


def _job(group, target, draft, cases):
    out = []
    for cp, layout, graph, dtype, kv in cases:
        rt = RuntimeConfig(dtype=dtype, layout=layout, graph=graph, kv_tokens=2048, kv_cache=kv, draft=draft)
        eng = PrefillEngine(target, rt, group, BUCKETS, ParallelConfig(cp_size=cp))
        res = prefill_after_prefixes(eng, _batch(), all_logits=True)
        out.append({"draft": res.draft, "last_logits": res.last_logits, "path": res.info.path,
                    "stats": eng.stats()["forwards"][-1], "bitwise": _replay_bitwise(eng) if graph != "off" else None})
    return out


def _replay_bitwise(eng) -> bool:
    """The draft's replay (after the target's, which fills what it reads) equals, bitwise,
    the same draft run eagerly on the same bucket: its rows and the K/V it wrote."""
    toks = [np.arange(40) % 512, np.arange(3) + 7]
    prep = eng.parts.preparer.prepare([Request(t) for t in toks])
    try:
        cap = eng.parts.runner.select(prep.plan.max_local_rows).capacity
        eng.parts.runner.try_replay(prep)
        ids = draft_input_ids(np.concatenate(toks), prep.plan.extend_lens, np.array([5, 6]),
                              prep.plan.rank(eng.rank).rows)
        graphs, layer = eng.parts.drafter.graphs, eng.parts.kv.layer(eng.parts.drafter.layer)
        pages = torch.tensor([p for s in prep.seq_ids for p in eng.parts.kv.handle(s).pages], dtype=torch.long)
        layer.index_fill_(0, pages, 0)  # (a page's slots past the batch's: zeros for both)
        want = [t.clone() for t in graphs.eager_on_bucket(prep, cap, ids)] + [layer[pages].clone()]
        layer.index_fill_(0, pages, 0)
        got = list(graphs.replay(prep, cap, ids, {})) + [layer[pages]]
        graph = graphs.graphs[cap][0]  # the draft layer's computation in segments, its attention a break
        ok = (len(graph.segments), len(graph.breaks)) == (2, 1) and all(torch.equal(a, b) for a, b in zip(got, want))
        if eng.parts.group.size == 1:  # capture() takes the draft's graph of every bucket after the target's
            eng.capture()
            ok = ok and set(graphs.graphs) == set(eng.parts.runner.graphs) == set(BUCKETS.capacities)
        return ok
    finally:
        eng.parts.preparer.abort(prep)


@pytest.fixture(scope="module")
def reference(models):
    """Per dtype, transformers' target (fc's input, logits) over each whole request."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    target, draft = models
    refs = {}
    for dtype in ("float32", "bfloat16"):
        hf = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
        full = [np.concatenate([p, n]) if p is not None else n for p, n in _batch()]
        refs[dtype] = (hf.model.embed_tokens.weight.detach(), [target_states(hf, ids) for ids in full], full)
    refs["weights"] = load_file(f"{draft}/model.safetensors")
    return refs


def _draft_reference(reference, dtype, j, nxt):
    embed, states, full = reference[dtype]
    logits, pre, kv = eagle3_reference(reference["weights"], embed, states[j][0], shifted(full[j], nxt))
    return logits, pre, kv


def _check(reference, cases, results, tol_scale=1.0):
    """Worst relative error of the draft's logits at the new positions, per (rank, case)."""
    worst = {}
    for rank, per_case in enumerate(results):
        for case, got in zip(cases, per_case):
            cp, layout, graph, dtype, kv = case
            d = got["draft"]
            errs = []
            for j, n in enumerate(LENS):
                want, pre, _ = _draft_reference(reference, dtype, j, int(d.next_tokens[j]))
                errs.append(rel_err(d.all_logits[j], want[-n:]))
            worst[(rank, case)] = max(errs)
    return worst


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_draft_logits_equal_the_reference(models, reference, ranks):
    cases = CASES[ranks]
    results = [_job(CPGroup(), *models, cases)] if ranks == 1 else launch(_job, ranks, *models, cases)
    worst = _check(reference, cases, results)
    for rank, per_case in enumerate(results):
        for case, got in zip(cases, per_case):
            cp, layout, graph, dtype, kv = case
            where = f"rank {rank}: CP {cp}, {layout}, graph={graph}, {dtype}, {kv}"
            d = got["draft"]
            assert worst[(rank, case)] <= TOL[dtype], f"{where}: {worst[(rank, case)]:.3g}"
            # greedy by default; the last position's logits are the per-token ones' last row
            assert torch.equal(d.next_tokens, got["last_logits"].argmax(-1)), where
            assert torch.equal(d.logits, torch.stack([x[-1] for x in d.all_logits])), where
            assert d.logits.shape == (len(LENS), 128) and d.logits.dtype == torch.float32
            for j, n in enumerate(LENS):
                _, pre, _ = _draft_reference(reference, dtype, j, int(d.next_tokens[j]))
                assert rel_err(d.hidden[j], pre[-1].float()) <= TOL[dtype], where
            w = reference["weights"]
            assert torch.equal(d.draft_to_target, torch.arange(128) + w["d2t"])
            assert got["path"] == ("graph" if graph != "off" else "eager"), where
            assert got["bitwise"] is (True if graph != "off" else None), where
            st = got["stats"]
            itemsize = 4 if dtype == "float32" else 2
            new = sum(LENS)
            assert st["draft_hidden_bytes_received"] == 0, where
            if cp > 1:
                assert st["draft_kv_bytes_received"] > 0, where
            stored = [r[case]["stats"]["draft_kv_bytes_stored"] for r in
                      [dict(zip(cases, p)) for p in results]]
            if kv == "replicated":
                assert stored == [new * KV_ROW * itemsize] * len(results), where
            else:  # each token's draft K/V on one rank: its own (sharded), the draft layer's owner (layer-split)
                assert sum(stored) == new * KV_ROW * itemsize, where


def _shift_after_sharding(flat, extend, next_tokens, rows):
    """The mutant: each rank shifts its own rows (row i takes the rank's row i + 1), so a
    row at the end of a zigzag block or an interleaved row takes a token of another
    position: a one-row misalignment."""
    local = flat[rows]
    out = np.empty_like(local)
    out[:-1] = local[1:]
    out[-1:] = local[-1:]
    ends = np.cumsum(extend) - 1
    last = np.isin(rows, ends)
    out[last] = next_tokens[np.searchsorted(ends, rows[last])]
    return out


def test_a_shift_after_sharding_fails_the_reference(models, reference, monkeypatch):
    cases = [(2, "zigzag", "off", "float32", "replicated")]
    right = _check(reference, cases, launch(_job, 2, *models, cases))
    monkeypatch.setattr(draft_runtime, "draft_input_ids", _shift_after_sharding)
    wrong = _check(reference, cases, launch(_job, 2, *models, cases))
    assert max(right.values()) <= TOL["float32"]
    assert min(wrong.values()) > 100 * TOL["float32"], wrong


def _chunks(group, target, draft):
    rt = RuntimeConfig(kv_tokens=2048, draft=draft)
    eng = PrefillEngine(target, rt, group)
    ids = np.random.default_rng(3).integers(0, 512, 30)
    h = eng.prefill([Request(ids[:12])]).handles[0]  # the draft's last row took the target's sample
    before = eng.parts.kv.snapshot()
    out = {}
    try:
        eng.prefill([Request(ids[12:], h)])
    except BatchError as e:
        out["refused"] = str(e)
    out["unchanged"] = eng.parts.kv.snapshot() == before
    eng.release(h)
    h = eng.prefill([Request(ids[:12])], draft_next=[int(ids[12])]).handles[0]
    out["chunked"] = eng.prefill([Request(ids[12:], h)], all_logits=True).draft.all_logits[0]
    out["whole"] = eng.prefill([Request(ids)], all_logits=True).draft.all_logits[0][12:]
    return out


def test_a_chunk_boundary_takes_the_next_prompt_token(models):
    """A forward ending mid-prompt must take the next prompt token as its last draft row's
    input (``draft_next``): then chunked equals whole; without it the next chunk is refused
    (that row's draft K/V would be stale), before anything changed."""
    for got in launch(_chunks, 2, *models):
        assert "last draft row took token" in got["refused"] and "\n" not in got["refused"]
        assert got["unchanged"]
        assert rel_err(got["chunked"], got["whole"]) <= TOL["float32"]


def test_what_a_draft_is_not_built_for_is_refused(models, hf_model_dir):
    target, draft = models
    # the pairs graphcp/combinations.py declares, refused before any weight loads
    with pytest.raises(ConfigError, match=r"ParallelConfig.pp_size > 1 with RuntimeConfig.draft: .*"
                                          r"use ParallelConfig.pp_size=1"):
        PrefillEngine(target, RuntimeConfig(kv_tokens=256, draft=draft), None, None, ParallelConfig(1, 2))
    with pytest.raises(ConfigError, match="microbatches=2"):
        RuntimeConfig(microbatches=2, draft=draft)
    with pytest.raises(ConfigError, match=r"\(DSA\) with RuntimeConfig.draft: .*MLA caches latents; use a dense "
                                          r"model or a MoE model"):
        PrefillEngine(str(hf_model_dir("deepseek_v32")), RuntimeConfig(kv_tokens=256, draft=draft))
    eng = PrefillEngine(target, RuntimeConfig(kv_tokens=256, draft=draft))
    with pytest.raises(BatchError, match="microbatches=2 with a draft"):
        eng.prefill([Request([1, 2])], microbatches=2)
    with pytest.raises(BatchError, match=r"draft_next\[0\] \(a token id\)"):
        eng.prefill([Request([1, 2])], draft_next=[512])
    with pytest.raises(BatchError, match="one token .or None. per request"):
        eng.prefill([Request([1, 2])], draft_next=[1, 2])
    # bad batches are the preparer's BatchErrors as without a draft, and change nothing
    h = eng.prefill([Request([1, 2])]).handles[0]
    before = eng.parts.kv.snapshot()
    for bad in ([Request("ab", h)], [Request([], h)], [Request([1], object())], (r for r in [Request([1])]), [],
                [Request([1, 2], h), Request([3], h)], [Request([1], dataclasses.replace(h, cache_id="other"))]):
        with pytest.raises(BatchError):
            eng.prefill(bad)
    assert eng.parts.kv.snapshot() == before
    plain = PrefillEngine(target, RuntimeConfig(kv_tokens=256))
    with pytest.raises(BatchError, match="draft_next needs an engine with a draft"):
        plain.prefill([Request([1, 2])], draft_next=[3])
    assert plain.prefill([Request([1, 2])]).draft is None
    assert LAYER_IDS == eng.parts.drafter.draft.aux_layer_ids


def _traffic(group, target, draft, kv, layout):
    """Every collective the draft phase runs before its outputs (the inputs and the draft's
    forward), as (operation, the tensor's shape, dtype), with the phase's stats."""
    from graphcp.dist import CPGroup as Group

    calls, phase = [], {"on": False}
    for name in ("all_gather_rows", "reduce_scatter_rows", "send_recv", "all_to_all_rows", "all_reduce_",
                 "broadcast_", "send", "recv_"):
        def record(self, *args, _name=name, _fn=getattr(Group, name), **kw):
            if phase["on"]:
                calls.extend((_name, tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))
            return _fn(self, *args, **kw)
        setattr(Group, name, record)
    run, outputs = draft_runtime.DraftRunner.run, draft_runtime.DraftRunner._outputs

    def run_recorded(self, *args, **kw):
        phase["on"] = True
        try:
            return run(self, *args, **kw)
        finally:
            phase["on"] = False

    def outputs_unrecorded(self, *args, **kw):
        phase["on"] = False
        return outputs(self, *args, **kw)

    draft_runtime.DraftRunner.run, draft_runtime.DraftRunner._outputs = run_recorded, outputs_unrecorded
    eng = PrefillEngine(target, RuntimeConfig(kv_tokens=1024, kv_cache=kv, layout=layout, draft=draft), group)
    res = prefill_after_prefixes(eng, _batch())
    return calls, res.info.stats


@pytest.mark.parametrize("kv, layout", [("replicated", "interleave"), ("sharded", "zigzag"),
                                        ("layer-split", "zigzag")])
def test_no_hidden_state_moves_to_feed_the_draft(models, kv, layout):
    """At CP 2, with a cached prefix: the collectives of the draft's inputs and forward
    carry no hidden-state rows (no tensor of width hidden or 3 x hidden), only cache slots
    and K/V (heads of 16, or pages), and the K/V bytes the stats count."""
    for calls, stats in launch(_traffic, 2, *models, kv, layout):
        assert calls, "the draft's K/V exchange runs collectives"
        hidden_wide = [c for c in calls if c[2].is_floating_point and c[1][-1] in (64, 192)]
        assert hidden_wide == [], hidden_wide
        assert stats["draft_hidden_bytes_received"] == 0 and stats["draft_kv_bytes_received"] > 0


@pytest.mark.parametrize("graph", ["off", "breakable"])
def test_asked_auxiliary_layers_ride_with_the_draft(models, graph):
    """Auxiliary layers asked besides the draft's (overlapping them) come back as without a
    draft, and the draft's logits do not depend on them."""
    target, draft = models
    batch = _batch()
    outs = {}
    for name, aux, d in (("both", (3, 0), draft), ("aux", (3, 0), None), ("draft", (), draft)):
        rt = RuntimeConfig(kv_tokens=2048, graph=graph, aux_hidden_layers=aux, draft=d)
        outs[name] = prefill_after_prefixes(PrefillEngine(target, rt, None, BUCKETS), batch, all_logits=True)
    both, aux, only = outs["both"], outs["aux"], outs["draft"]
    for j in range(len(LENS)):
        assert torch.equal(both.aux_hidden[j], aux.aux_hidden[j])
        assert torch.equal(both.draft.all_logits[j], only.draft.all_logits[j])
    assert both.info.path == ("graph" if graph != "off" else "eager")
