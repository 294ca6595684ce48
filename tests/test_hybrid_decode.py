"""Decode of the linear-attention hybrids against transformers (issue 47, docs/hybrid.md
"Decode"), on tests/conftest.py's tiny Qwen3.5, Qwen3.5-MoE (``ep`` and ``tp``), Qwen3-Next
and the multimodal Qwen3.5's text model:

- greedy decoding of a batch of requests of different lengths (a prefill, then one step a
  token) gives transformers' greedy ``generate``'s ids for 16 new tokens and every step's
  logits within 1e-4 (float32), eagerly and on the decode graphs (a dense hybrid's step one
  launch: its linear layers' steps inside the graph, each bucket's first replay checked),
  at CP 1, 2 and 4 on every cache mode (CP 4 and the rest of the matrix: slow), and under
  attention TP 2; bfloat16 within 2e-2 of transformers in bfloat16 on the same sequence
  (each family at CP 2, the MoE ones' all-experts twins);
- a three-turn conversation (each turn prefilled after the decoded tokens: the scan starts
  from the decoded state) matches transformers on the whole sequence;
- a failed step and a refused one leave every state, slot and page as they were, and
  decoding then goes on exactly; a decode graph whose replay differs from the eager step
  in a state it writes is refused on every rank, the states as they were.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import hf_greedy, rel_err
from test_decode import _check_conversation, conversation, greedy

from graphcp import BatchError, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import CPGroup, launch
from graphcp.model.hybrid.layers import GatedAttention

MODES = ("replicated", "sharded", "layer-split")
LENS = (7, 29, 1)
NEW = 16
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
PAGE = 16
#: name -> (tests/conftest.py's family, RuntimeConfig.moe)
FAMILIES = {"qwen3_5": ("qwen3_5_text", "ep"), "moe-ep": ("qwen3_5_moe_text", "ep"),
            "moe-tp": ("qwen3_5_moe_text", "tp"), "next": ("qwen3_next", "ep"), "multimodal": ("qwen3_5", "ep")}
#: the fast runs at CP 2 of the families but Qwen3.5 (which runs every mode): one mode each
ONE_MODE = {"moe-ep": "sharded", "moe-tp": "layer-split", "next": "sharded", "multimodal": "layer-split"}
#: bfloat16 runs at CP 2: (family, mode); the MoE models' all-experts twins (as
#: tests/test_moe_parity.py does: a router's near-tie flips an expert under bfloat16 rounding)
BF16 = (("qwen3_5", "replicated"), ("qwen3_5", "sharded"), ("moe-ep", "sharded"), ("next", "layer-split"),
        ("multimodal", "sharded"))
ALL_EXPERTS = {"moe-ep": dict(num_experts_per_tok=8), "next": dict(num_experts_per_tok=8)}


def _cases(cp: int, slow: bool) -> list[tuple[str, str]]:
    """The (family, cache mode) runs at ``cp``: the fast ones, or (``slow``) the rest."""
    fast = {1: [("qwen3_5", m) for m in MODES] + [(f, "replicated") for f in ONE_MODE],
            2: [("qwen3_5", m) for m in MODES] + list(ONE_MODE.items()), 4: []}[cp]
    if not slow:
        return fast
    return [(f, m) for f in FAMILIES for m in MODES if (f, m) not in fast]


def _prompts(lens=LENS, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n) for n in lens]


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    out = {name: hf_model_dir(family) for name, (family, _) in FAMILIES.items()}
    for name in {n for n, _ in BF16}:
        out[name, "bfloat16"] = hf_model_dir(FAMILIES[name][0], False, "bfloat16", **ALL_EXPERTS.get(name, {}))
    return out


@pytest.fixture(scope="module")
def reference(folders, hf_model):
    """family -> transformers' greedy generate of each prompt alone: tokens [R, NEW], logits [R, NEW, V]."""
    out = {}
    for name in FAMILIES:
        model = hf_model(folders[name], "float32")
        out[name] = hf_greedy(model, _prompts(), NEW)
    return out


def _engine(folders, group, name: str, mode: str, dtype: str = "float32", graph: str = "breakable"):
    folder = folders[(name, "bfloat16") if dtype == "bfloat16" else name]
    return PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=1024, kv_cache=mode, graph=graph,
                                               page_size=PAGE, moe=FAMILIES[name][1]), group)


def _job(group, folders: dict, cases, conversations: bool) -> dict:
    """Each case eagerly and on the graphs (its steps' figures), with its conversation."""
    out = {}
    for name, mode in cases:
        engine = _engine(folders, group, name, mode)
        for path in ("eager", "graph"):
            out[name, mode, path] = greedy(engine, _prompts(), NEW, path == "eager")
        if conversations:
            out[name, mode, "conversation"] = conversation(engine, 512)
        out[name, mode, "stored"] = engine.parts.kv.stored_tokens()
        out[name, mode, "steps"] = engine.stats()["decode_steps"]
    if conversations and group.size == 2:
        for name, mode in BF16:
            out["bfloat16", name, mode] = greedy(_engine(folders, group, name, mode, "bfloat16"), _prompts(), NEW,
                                                 False)
    return out


_RUNS: dict = {}


def _runs(folders, cp: int, slow: bool) -> list[dict]:
    """Every rank's results of :func:`_job` at ``cp`` (made once)."""
    key = cp, slow
    if key not in _RUNS:
        cases, conv = _cases(cp, slow), cp == 2 and not slow or cp == 4
        _RUNS[key] = ([_job(CPGroup(), folders, cases, conv)] if cp == 1 else
                      launch(_job, cp, folders, cases, conv))
    return _RUNS[key]


def _check_greedy(ranks: list[dict], reference, cases) -> None:
    for rank, got in enumerate(ranks):
        for name, mode in cases:
            ref_tokens, ref_logits = reference[name]
            for path in ("eager", "graph"):
                toks, logits, paths = got[name, mode, path]
                where = (name, mode, path, rank)
                assert torch.equal(toks, ref_tokens), where
                for i in range(NEW):
                    assert rel_err(logits[:, i], ref_logits[:, i]) <= TOL["float32"], (*where, i)
                assert set(paths) == {path}, where
            assert got[name, mode, "stored"] == 0, (name, mode, rank)  # every handle released
            graph = [s for s in got[name, mode, "steps"] if s["path"] == "graph"]
            assert graph and all(s["bucket"] == {3: 4, 2: 2}[s["rows"]] for s in graph), (name, mode)
            if FAMILIES[name][1] == "tp" or name == "qwen3_5":  # no ep exchange: the whole step one launch
                assert {s["launches"] for s in graph} == {1}, (name, mode)
            assert {s["linear_kernels"] for s in got[name, mode, "steps"]} == {"torch"}
    for got in ranks[1:]:  # every rank returns the same logits
        for name, mode in cases:
            assert torch.equal(got[name, mode, "eager"][1], ranks[0][name, mode, "eager"][1]), (name, mode)


@pytest.mark.parametrize("cp", [1, 2])
def test_greedy_decoding_matches_transformers_generate(folders, reference, cp):
    _check_greedy(_runs(folders, cp, False), reference, _cases(cp, False))


@pytest.mark.slow
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_every_family_and_cache_mode_matches_transformers(folders, reference, cp):
    _check_greedy(_runs(folders, cp, True), reference, _cases(cp, True))


def _conversations(ranks: list[dict], folders, hf_model, cases) -> None:
    for name, mode in cases:
        hf = hf_model(folders[name], "float32")
        for got in ranks:
            _check_conversation(got[name, mode, "conversation"], hf)


def test_a_conversation_scans_each_turn_from_the_decoded_state(folders, hf_model):
    _conversations(_runs(folders, 2, False), folders, hf_model, _cases(2, False))


@pytest.mark.slow
def test_a_conversation_at_cp4(folders, hf_model):
    _conversations(_runs(folders, 4, True), folders, hf_model, _cases(4, True))


@pytest.mark.parametrize("name,mode", BF16)
def test_bfloat16_decoding_matches_transformers_on_the_same_sequence(folders, hf_model, name, mode):
    model = hf_model(folders[name, "bfloat16"], "bfloat16")
    toks, logits, _ = _runs(folders, 2, False)[0]["bfloat16", name, mode]
    for j, p in enumerate(_prompts()):
        seq = torch.cat([torch.from_numpy(p), toks[j, :-1]]).view(1, -1)
        with torch.inference_mode():
            ref = model(input_ids=seq).logits[0, len(p) - 1:].float()
        assert rel_err(logits[j], ref) <= TOL["bfloat16"], j


def _states(engine: PrefillEngine) -> tuple:
    """What a failed step must leave as it was: the allocator's record, which slot holds
    each live request's states and those states (its other slot is the next step's to write)."""
    kv = engine.parts.kv
    states = kv.storage.states
    rows = sorted(kv.table_rows(list(kv.allocator.table.live())))
    slots = torch.tensor([states.committed_slot(r) for r in rows], dtype=torch.int64)
    pools = {n: p.index_select(1, slots) for n, p in kv.state_pools().items()}
    return kv.snapshot(), pools, slots.numpy()


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and all(torch.equal(a[1][n], b[1][n]) for n in a[1]) and np.array_equal(a[2], b[2])


def test_a_failed_or_refused_step_leaves_the_states_and_decoding_goes_on(folders, reference, monkeypatch):
    engine = _engine(folders, CPGroup(), "qwen3_5", "replicated", graph="off")
    out = engine.prefill([Request(p) for p in _prompts()])
    handles, logits, tok = out.handles, [out.last_logits], out.last_logits.argmax(-1)
    for i in range(NEW - 1):
        if i == 3:
            before = _states(engine)
            with monkeypatch.context() as m:  # after layers 0-2 (linear) wrote their new states
                m.setattr(GatedAttention, "project", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
                with pytest.raises(RuntimeError, match="injected"):
                    engine.decode(handles, tok)
            assert _same(_states(engine), before)
            with pytest.raises(BatchError, match="outside the vocabulary"):
                engine.decode(handles, [1, 2, 512])
            assert _same(_states(engine), before)
            snap = engine.parts.kv.snapshot()  # several rows a request: the states take one token a step
            with pytest.raises(BatchError, match="2 rows a request on a cache with per-request states"):
                engine.decode(handles, [[1, 2]] * 3)
            assert _same(_states(engine), before) and engine.parts.kv.snapshot() == snap
        o = engine.decode(handles, tok, logits=True)
        handles, tok = o.handles, o.logits.argmax(-1)
        logits.append(o.logits)
    ref_tokens, ref_logits = reference["qwen3_5"]
    got = torch.stack(logits, 1)
    assert torch.equal(got.argmax(-1), ref_tokens) and rel_err(got, ref_logits) <= TOL["float32"]


def _corrupt_state_job(group, folders: dict) -> dict:
    """A decode graph whose replay on rank 0 writes one state value differently from the
    eager step: the step refused on both ranks, every state as before, then run eagerly."""
    from graphcp.runtime.capture.graphs import CaptureError

    engine = _engine(folders, group, "qwen3_5", "sharded")
    out = engine.prefill([Request(p) for p in _prompts()])
    graphs, capture = engine.parts.decoder.graphs, engine.parts.runner.capture_bucket
    recurrent = engine.parts.kv.state_pools()["linear_recurrent"]

    def corrupted(key, phase):
        captured = capture(key, phase)
        if engine.world_rank == 0:
            graph = graphs.graphs[key].graph
            replay = graph.replay
            # (the slots the step's requests write, of layer 1)
            graph.replay = lambda ctx: (replay(ctx), recurrent[1].index_fill_(0, ctx.kv.state_slots[1, :3], 0.5))
        return captured

    engine.parts.runner.capture_bucket = corrupted
    tok = out.last_logits.argmax(-1)
    before = _states(engine)
    try:
        engine.decode(out.handles, tok)
    except CaptureError as e:
        same = _same(_states(engine), before)
        eager = engine.decode(out.handles, tok, force_eager=True, logits=True)
        return {"error": str(e), "same": same, "logits": eager.logits, "first": out.last_logits}
    return {"error": None}


def test_a_replay_whose_state_differs_is_refused_on_every_rank(folders, reference):
    ranks = launch(_corrupt_state_job, 2, folders)
    assert "linear_recurrent" in ranks[0]["error"], ranks[0]["error"]
    assert "another rank's output differs" in ranks[1]["error"]
    ref_logits = reference["qwen3_5"][1]
    for r in ranks:
        assert r["same"]
        assert rel_err(r["logits"], ref_logits[:, 1]) <= TOL["float32"]


def test_generate_and_the_command_match_transformers(folders, reference, hf_model, tmp_path, capsys):
    """``engine.generate`` (a conversation's first turn and two prompts) at CP 1, and
    ``graphcp generate --cp 2 --kv-cache sharded`` on the decode graphs: transformers' ids."""
    from graphcp import Conversation
    from graphcp.cli.main import main

    ref_tokens, ref_logits = reference["qwen3_5"]
    prompts = [p.tolist() for p in _prompts()]
    engine = _engine(folders, CPGroup(), "qwen3_5", "replicated")
    out = engine.generate([prompts[0], Request(prompts[1]), Conversation([prompts[2]])], NEW, logits=True)
    for j in range(3):
        assert out.tokens[j] == [ref_tokens[j].tolist()], j
        assert rel_err(out.logits[j][0], ref_logits[j]) <= TOL["float32"], j
    rows = tmp_path / "r.jsonl"
    rows.write_text("".join(f'{{"tokens": {p}}}\n' for p in prompts))
    res = tmp_path / "out.pt"
    argv = ["generate", "--model", str(folders["qwen3_5"]), "--input", str(rows), "--output", str(res), "--cp", "2",
            "--kv-cache", "sharded", "--graph", "breakable", "--max-new-tokens", str(NEW), "--kv-tokens", "1024"]
    assert main(argv) == 0, capsys.readouterr().err
    assert torch.load(res)["tokens"] == [[t.tolist()] for t in ref_tokens]


def _tp_job(group, folders: dict, cp: int) -> dict:
    """Attention TP 2 in each CP partition: both layer kinds' heads split, the linear
    states a rank's share of the heads; greedy on the graphs, every cache mode at CP 2."""
    from graphcp import ParallelConfig

    par = ParallelConfig(cp_size=cp, tp_size=2 * cp)
    out = {}
    for mode in MODES if cp > 1 else ("replicated",):
        rt = RuntimeConfig(kv_tokens=1024, kv_cache=mode, graph="breakable", page_size=PAGE)
        out[mode] = greedy(PrefillEngine(folders["qwen3_5"], rt, group, parallel=par), _prompts(), NEW, False)
    return out


@pytest.mark.parametrize("cp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_attention_tp_decodes_as_transformers(folders, reference, cp):
    ref_tokens, ref_logits = reference["qwen3_5"]
    for rank, got in enumerate(launch(_tp_job, 2 * cp, folders, cp)):
        for mode, (toks, logits, paths) in got.items():
            assert torch.equal(toks, ref_tokens) and set(paths) == {"graph"}, (rank, mode)
            assert rel_err(logits, ref_logits) <= TOL["float32"], (rank, mode)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_graph_steps_padding_rows_leave_every_read_state_bitwise(folders, dtype):
    """Three requests replay the bucket of 4: the padding row reads and writes the first
    request's read slot; every slot the step read holds what it held (a rollback then
    returns to it), and the step wrote new states to the other slots."""
    engine = _engine(folders, CPGroup(), "qwen3_5", "replicated", dtype)
    out = engine.prefill([Request(p) for p in _prompts()])
    pools = engine.parts.kv.state_pools()
    every = {n: p.clone() for n, p in pools.items()}
    assert engine.capture_decode(pages=4) == [64, 32, 16, 8, 4, 2, 1]  # (inert rows: every state kept)
    assert all(torch.equal(p, every[n]) for n, p in pools.items())
    _, read, slots = _states(engine)
    step = engine.decode(out.handles, out.last_logits.argmax(-1), logits=True)
    assert (step.info.path, step.info.bucket) == ("graph", 4)
    _, after, _ = _states(engine)
    for name, pool in pools.items():
        assert torch.equal(pool.index_select(1, torch.from_numpy(slots)), read[name]), name
        assert not torch.equal(after[name], read[name]), name


def _export_job(group, folders: dict) -> dict:
    """A prompt, 5 decode steps, its KV exported (the decoded tokens' states and K/V), then 4
    more steps: the tokens fed and the later steps' logits, per cache mode."""
    out = {}
    for mode in MODES:
        engine = _engine(folders, group, "qwen3_5", mode, graph="off")
        first = engine.prefill([Request(_prompts()[1])])
        handle, tok, fed = first.handles[0], int(first.last_logits.argmax()), []
        for i in range(9):
            if i == 5:
                out[mode, "export"] = engine.export_kv(handle)
            step = engine.decode([handle], [tok], logits=True)
            fed.append(tok)
            handle, tok = step.handles[0], int(step.logits[0].argmax())
            if i >= 5:
                out.setdefault((mode, "after"), []).append(step.logits[0])
        out[mode, "fed"] = fed
        engine.release(handle)
    return out


def test_the_export_after_decoding_continues_in_transformers(folders, hf_model, tmp_path):
    """The export after decode steps holds each linear layer's decoded state (the slot the
    last step wrote) and the decoded tokens' K/V: transformers continues from it as the
    engine's next steps do (CP 2, every cache mode)."""
    from graphcp.pd.files import save_kv
    from graphcp.pd.hf import cache_argument
    from graphcp.pd.load import load_kv

    model = hf_model(folders["qwen3_5"], "float32")
    got = launch(_export_job, 2, folders)[0]
    for mode in MODES:
        fed, after = got[mode, "fed"], torch.stack(got[mode, "after"])
        loaded = load_kv(save_kv(got[mode, "export"].check(), tmp_path / f"{mode}.safetensors"))
        assert loaded.num_tokens == len(_prompts()[1]) + 5, mode
        with torch.inference_mode():
            steps = torch.stack([model(input_ids=torch.tensor([[t]]), use_cache=True,
                                       **{cache_argument(model): loaded.cache}).logits[0, -1].float()
                                 for t in fed[5:]])
        assert rel_err(steps, after) <= TOL["float32"], mode
