"""Speculative decoding of a linear-attention hybrid with an EAGLE-3 draft (issue 47,
docs/speculative.md and docs/hybrid.md, "Speculative decoding").

A verify step gives each request k + 1 rows; through a linear layer they advance the
request's conv and recurrent states one after the other, each row's states kept, and the
acceptance leaves the state after the last kept row. On tests/conftest.py's tiny Qwen3.5
(hidden 64 and head_dim 16 here, the shape tests/eagle3_ref.py's drafts fit):

- ``generate(..., draft_tokens=k)`` gives plain greedy decoding's ids token for token, and
  each token's logits within the suite's bound of plain decoding's, with a random draft
  (accepts almost nothing: every round keeps one row and takes the state after it), a
  draft that agrees with a target that counts (keeps every row) and one that agrees on half
  the tokens (runs of every length, different in each request), at CP 1 and 2 (4: slow) on
  every cache mode, float32 and bfloat16 (at CP 2 every draft x mode x dtype: slow),
  eagerly and on the decode graphs (a verify step replays a graph of its own rows a
  request), and in a two-turn conversation (the next turn's scan starts from the accepted
  state);
- the cache's free pages and state rows after release equal those before;
- a verify step of more rows than the largest decode bucket runs eagerly, its rows' states
  in a spill buffer, and gives the same tokens;
- the GPU kernels' wiring (fla's rule one call a row, causal-conv1d's update over the n
  rows) through tests/test_hybrid_decode_kernels.py's fakes equals the torch path.

A selection that kept the last row's state instead of the accepted one moves the random
draft's tokens and the half-agreeing draft's logits by 2e-1 (checked by hand).
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from eagle3_ref import draft_config, draft_tensors, write_agreeing_draft, write_draft
from helpers import rel_err
from test_hybrid_decode_kernels import CALLS, fake_causal_conv1d_update, fake_fused_recurrent

from graphcp import Conversation, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import CPGroup, launch
from graphcp.model.hybrid import step_kernels

LENS = (7, 29, 1)
NEW = 8
K = 3
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
#: the tiny Qwen3.5 at the drafts' attention shape (4 heads, 2 KV heads of 16, hidden 64)
SHAPE = dict(hidden_size=64, head_dim=16)
MODES = ("replicated", "sharded", "layer-split")
#: (draft, cache mode, dtype, graph) of the default runs; --slow runs every other one too
FAST = {1: [("random", "sharded", "float32", "off"), ("agreeing", "replicated", "bfloat16", "breakable"),
            ("partial", "layer-split", "float32", "breakable")],
        2: [("partial", "sharded", "float32", "breakable"), ("random", "layer-split", "bfloat16", "off"),
            ("agreeing", "replicated", "float32", "off")]}


def _all_cases() -> list[tuple[str, str, str, str]]:
    return [(d, m, t, "breakable" if t == "float32" else "off") for d in ("random", "agreeing", "partial")
            for m in MODES for t in ("float32", "bfloat16")]


@pytest.fixture(scope="module")
def models(hf_model_dir, tmp_path_factory):
    """draft name -> (target folder, draft folder): the random target with a random draft,
    a counting target (its greedy token the one after the current one) with a draft that
    agrees with it and one that agrees on half the tokens."""
    from transformers import AutoModelForCausalLM

    target = hf_model_dir("qwen3_5_text", **SHAPE)
    root = tmp_path_factory.mktemp("speculative-hybrid")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():  # every layer's output scaled down (they still move every logit)
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                p.mul_(0.05)
        model.lm_head.weight.copy_(torch.roll(model.model.embed_tokens.weight, 1, dims=0))
    model.save_pretrained(root / "counting")
    counting = root / "counting"
    return {"random": (str(target), str(write_draft(root / "draft", draft_tensors(), draft_config()))),
            "agreeing": (str(counting), str(write_agreeing_draft(root / "agreeing", counting))),
            "partial": (str(counting), str(write_agreeing_draft(root / "partial", counting, swap=True)))}


def _prompts(seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n).tolist() for n in LENS]


def _engine(group, models: dict, draft: str, mode: str, dtype: str, graph: str, **kw) -> PrefillEngine:
    target, folder = models[draft]
    return PrefillEngine(target, RuntimeConfig(dtype=dtype, kv_tokens=1024, kv_cache=mode, graph=graph, page_size=16,
                                               draft=folder, **kw), group)


def _run(eng: PrefillEngine) -> dict:
    """Plain greedy and speculative generation of the same requests (a batch, then a
    two-turn conversation); the free pages and state rows before and after."""
    kv = eng.parts.kv
    table = kv.allocator.table
    free = (kv.num_free_pages, table.num_free_rows)
    plain = eng.generate(_prompts(), NEW, logits=True)
    spec = eng.generate(_prompts(), NEW, logits=True, draft_tokens=K)
    conv = [Conversation([[5, 9, 200, 7], [11, 3]]), Conversation([list(range(40, 61)), [1]])]
    plain_conv, spec_conv = eng.generate(conv, 4), eng.generate(conv, 4, draft_tokens=2)
    verify = [s for s in eng.stats()["decode_steps"] if s.get("rows_per_request", 1) > 1]
    return {"plain": plain, "spec": spec, "plain_conv": plain_conv.tokens, "spec_conv": spec_conv.tokens,
            "free": (free, (kv.num_free_pages, table.num_free_rows)), "live": len(table.live()),
            "paths": {s["path"] for s in verify}}


def _job(group, models: dict, cases) -> dict:
    return {case: _run(_engine(group, models, *case)) for case in cases}


def _check(results: dict, where: str) -> None:
    for (draft, mode, dtype, graph), r in results.items():
        at = f"{where} {draft} {mode} {dtype} graph={graph}"
        plain, spec = r["plain"], r["spec"]
        assert spec.tokens == plain.tokens and r["spec_conv"] == r["plain_conv"], at
        worst = max(rel_err(a, b) for x, y in zip(plain.logits, spec.logits) for a, b in zip(x, y))
        assert worst < TOL[dtype], (at, worst)
        assert r["free"][0] == r["free"][1] and r["live"] == 0, at
        # a verify step replays the decode graph of its rows (eager with graphs off)
        assert r["paths"] == {"graph" if graph == "breakable" else "eager"}, (at, r["paths"])
        rate = spec.speculative["acceptance_rate"]
        assert {"random": rate < 0.2, "agreeing": rate == 1.0, "partial": 0.2 < rate < 0.9}[draft], (at, rate)
        assert draft == "random" or spec.speculative["steps_saved"] > 0, (at, spec.speculative)


def _results(models, cp: int, cases) -> list[dict]:
    return [_job(CPGroup(), models, cases)] if cp == 1 else launch(_job, cp, models, cases)


@pytest.mark.parametrize("cp", [1, 2])
def test_speculative_decoding_of_a_hybrid_equals_plain_greedy(models, cp):
    for rank, res in enumerate(_results(models, cp, FAST[cp])):
        _check(res, f"CP {cp} rank {rank}")


@pytest.mark.slow
def test_every_draft_mode_and_dtype_at_cp2(models):
    cases = [c for c in _all_cases() if c not in FAST[2]]
    for rank, res in enumerate(_results(models, 2, cases)):
        _check(res, f"CP 2 rank {rank}")


@pytest.mark.slow
def test_speculative_decoding_of_a_hybrid_at_cp4(models):
    cases = [("partial", m, "float32", "breakable") for m in ("sharded", "layer-split")]
    for rank, res in enumerate(launch(_job, 4, models, cases)):
        _check(res, f"CP 4 rank {rank}")


def test_a_verify_step_larger_than_every_bucket_spills_its_rows_states(models):
    """Decode buckets of at most 4 rows: the batch's verify steps (3 requests x 4 rows) run
    eagerly, their rows' states in the spill buffer; a one-request conversation's (3 rows)
    replay a graph, its rows' states in the cache's verify slots."""
    eng = _engine(CPGroup(), models, "partial", "replicated", "float32", "breakable", decode_buckets=(1, 2, 4))
    states = eng.parts.kv.storage.states
    assert states.verify_rows == 4
    plain = eng.generate(_prompts(), NEW, logits=True)
    spec = eng.generate(_prompts(), NEW, logits=True, draft_tokens=K)
    assert spec.tokens == plain.tokens and states._spill is not None
    conv = [Conversation([list(range(40, 61)), [1]])]
    assert eng.generate(conv, 4, draft_tokens=2).tokens == eng.generate(conv, 4).tokens
    verify = [s for s in eng.stats()["decode_steps"] if s.get("rows_per_request", 1) > 1]
    assert {s["path"] for s in verify} == {"eager", "graph"}
    worst = max(rel_err(a, b) for x, y in zip(plain.logits, spec.logits) for a, b in zip(x, y))
    assert worst < TOL["float32"], worst


def test_the_gpu_kernels_wiring_of_a_verify_step_equals_the_torch_path(models, monkeypatch):
    """fla's rule (one T = 1 call a row, from the previous row's state) and causal-conv1d's
    update (the n rows in one call, ``x`` ``[B, C, n]``) through the fakes."""
    fla, ops, gdr = (types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.gated_delta_rule"))
    gdr.fused_recurrent_gated_delta_rule = fake_fused_recurrent
    conv = types.ModuleType("causal_conv1d")
    conv.causal_conv1d_update = fake_causal_conv1d_update
    for name, mod in (("fla", fla), ("fla.ops", ops), ("fla.ops.gated_delta_rule", gdr), ("causal_conv1d", conv)):
        monkeypatch.setitem(sys.modules, name, mod)
    for calls in CALLS.values():
        calls.clear()

    def run(kernels):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(step_kernels, "select_step_kernels", lambda device: kernels)
            eng = _engine(CPGroup(), models, "partial", "sharded", "float32", "off")
            return eng.generate(_prompts(), NEW, logits=True, draft_tokens=K)

    fakes = step_kernels.StepKernels("fla+causal-conv1d", step_kernels.fla_step_rule(),
                                     step_kernels.causal_conv1d_step(), step_kernels.causal_conv1d_rows())
    got, want = run(fakes), run(step_kernels.TORCH_STEP)
    assert got.tokens == want.tokens
    assert max(rel_err(a, b) for x, y in zip(got.logits, want.logits) for a, b in zip(x, y)) <= 1e-5
    seqlens = {args[0].shape[-1] for args, _ in CALLS["conv"] if args[0].dim() == 3}
    assert K + 1 in seqlens, seqlens  # a verify step's rows in one call
    assert {args[0].shape[1] for args, _ in CALLS["fla"]} == {1}  # one token a call


def _export_after_speculation(group, models: dict) -> list:
    """Each request's export after a speculative generation (the requests kept)."""
    eng = _engine(group, models, "partial", "sharded", "float32", "off")
    gen = eng.generate(_prompts()[:2], NEW, draft_tokens=K, release=False)
    return [gen.tokens, eng.export_kv_batch(gen.handles)]


def test_the_export_after_speculation_holds_the_draft_layer_and_continues_in_transformers(models, hf_model,
                                                                                          tmp_path):
    """At CP 2: graphcp-hybrid/1 with the draft's K/V layer after the model's
    (``draft_layers = 1``), every rank's the same; ``load_kv``'s transformers cache (the
    model's layers) continues the sequence as transformers' own run of it does."""
    from graphcp.pd.files import save_kv
    from graphcp.pd.hf import cache_argument
    from graphcp.pd.load import load_kv

    ranks = launch(_export_after_speculation, 2, models)
    (tokens, exports), other = ranks[0], ranks[1][1]
    model = hf_model(models["partial"][0], "float32")
    for j, (e, o) in enumerate(zip(exports, other)):
        m = e.meta
        assert (m.draft_layers, m.num_layers, m.layer_kinds[-1], m.target_layers) == (1, 5, "full", 4), m
        assert all(a.equal(b) for x, y in zip(e.layers, o.layers) for a, b in zip(x.values(), y.values()))
        seq = _prompts()[j] + tokens[j][0]  # the prompt, the generated tokens (the last one's K/V not yet computed)
        cache = load_kv(save_kv(e.check(), tmp_path / f"{j}.safetensors")).cache
        assert len(cache.layers) == 4 and int(cache.get_seq_length()) == len(seq) - 1
        with torch.no_grad():
            want = model(torch.tensor([seq + [7]])).logits[0, -2:].float()
            got = torch.stack([model(input_ids=torch.tensor([[t]]), use_cache=True,
                                     **{cache_argument(model): cache}).logits[0, -1].float() for t in (seq[-1], 7)])
        assert rel_err(got, want) <= 1e-4, j


def test_a_verify_replay_whose_row_state_differs_is_refused(models):
    """A verify-shaped step (3 rows a request) whose graph replay writes one row's kept
    state (a verify slot) differently from the eager step: the decode graph's self-check
    refuses it (one line), every request's states, slots and pages as they were; the same
    step then runs eagerly."""
    from graphcp.runtime.capture.graphs import CaptureError

    eng = _engine(CPGroup(), models, "partial", "replicated", "float32", "breakable")
    kv, states = eng.parts.kv, eng.parts.kv.storage.states
    graphs, capture = eng.parts.decoder.graphs, eng.parts.runner.capture_bucket

    def corrupted(key, phase):
        captured = capture(key, phase)
        if isinstance(key, tuple) and len(key) == 3:  # a verify step's graph: its row 1's state of layer 1
            graph = graphs.graphs[key].graph
            replay = graph.replay
            row = states.recurrent[1, states.verify_base + 1]
            graph.replay = lambda ctx: (replay(ctx), row.fill_(0.5))
        return captured

    eng.parts.runner.capture_bucket = corrupted
    handles = eng.prefill([Request(p) for p in _prompts()[:2]]).handles
    toks = [[3, 4, 5], [6, 7, 8]]
    before = states.recurrent.clone(), states.conv.clone(), kv.snapshot(), states._phase.copy()
    with pytest.raises(CaptureError, match=r"3 rows a request.*linear_recurrent") as e:
        eng.decode(handles, toks)
    assert "\n" not in str(e.value)
    assert kv.snapshot() == before[2] and np.array_equal(states._phase, before[3])
    live = states.verify_base  # the requests' slots (the verify slots are a step's scratch: a capture writes them)
    assert torch.equal(states.recurrent[:, :live], before[0][:, :live])
    assert torch.equal(states.conv[:, :live], before[1][:, :live])
    out = eng.decode(handles, toks, force_eager=True)
    assert out.info.path == "eager" and out.handles[0].num_tokens == handles[0].num_tokens + 3
