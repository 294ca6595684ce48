"""Decode for DeepSeek V4 against transformers (issue 47, docs/dsv4.md).

Each decode step writes the new token's window row and its compressors' source rows; a
compressor accumulates its block over the steps and emits an entry when the block
completes (CSA every 4 tokens, HCA every 8); the CSA indexer scores the entries so far
and keeps the top index_topk (3); attention runs over the window (8) and the entries,
with mHC (2 streams) and hash / score-routed MoE per token. On the replicated cache
every rank runs it; on the layer-split cache the layer's owner pools and attends and
broadcasts the output. Greedy decoding of a batch of requests of mixed lengths must give
transformers' greedy ``generate``'s 16 token ids (transformers decodes V4 with its own
cache: the compressor states) and each step's logits within 1e-4 (float32), eagerly and
on the decode graphs (the first replay of each bucket self-checked), at CP 1, 2 and 4 on
each cache, MoE ``ep`` and ``tp``. A three-turn conversation matches transformers on the
whole sequence. bfloat16 within 2e-2 of transformers in bfloat16 on the twin that scores
no row and routes every token to every expert (a bfloat16 rounding flips near-tied
top-k choices: tests/test_dsv4.py). A step at the context limit is one line that changes
nothing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import save_cases
from helpers import hf_greedy, rel_err
from test_decode import conversation, greedy

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.cli.main import main
from graphcp.dist import CPGroup, launch
from graphcp.errors import BatchError
from graphcp.pd.files import save_kv
from graphcp.pd.hf import cache_argument
from graphcp.pd.load import load_kv

NEW = 16
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
LENS = (5, 30, 13)  # no entry yet / past index_topk CSA entries from the prefill / crossing both rates decoding
PAGE = 8
CASES = {
    "v4": ("deepseek_v4", {}),
    # bfloat16: no row sees more than index_topk entries, every token to every expert
    "v4-unscored": ("deepseek_v4", dict(num_experts_per_tok=8, index_topk=64)),
    "v4-short": ("deepseek_v4", dict(max_position_embeddings=40)),  # the refused step
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_cases(tmp_path_factory, CASES, seed=3)


def _prompts(seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n) for n in LENS]


def _engine(folder, group, mode: str, moe: str = "ep", dtype: str = "float32") -> PrefillEngine:
    return PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=2048, kv_cache=mode, graph="breakable",
                                               page_size=PAGE, moe=moe), group)


def _modes(cp: int) -> tuple[str, ...]:
    return ("replicated",) if cp == 1 else ("replicated", "layer-split")


def _refuse_at_context(eng: PrefillEngine) -> str:
    """A request at the model's context: one line, the cache (its pages and pools) unchanged."""
    ctx = eng.max_context
    h = eng.prefill([Request(np.arange(ctx - 1) % 512)]).handles[0]
    h = eng.decode([h], [1]).handles[0]  # the last position
    snap, pools = eng.parts.kv.snapshot(), {n: p.clone() for n, p in eng.parts.kv.page_pools().items()}
    try:
        eng.decode([h], [1])
    except BatchError as e:
        msg = str(e)
    else:
        raise AssertionError("a step past the context ran")
    assert eng.parts.kv.snapshot() == snap
    assert all(torch.equal(p, pools[n]) for n, p in eng.parts.kv.page_pools().items())
    eng.release(h)
    return msg


def _job(group, folders: dict, cp: int) -> dict:
    out = {}
    for mode in _modes(cp):
        for moe in ("ep", "tp") if cp == 2 else ("ep",):
            eng = _engine(folders["v4"], group, mode, moe)
            for path in ("eager", "graph"):
                out[mode, moe, path] = greedy(eng, _prompts(), NEW, path == "eager")
            if cp == 2 and moe == "ep":
                out[mode, "conversation"] = conversation(eng, 512)
            out[mode, moe, "steps"] = eng.stats()["decode_steps"]
            out[mode, moe, "stored"] = eng.parts.kv.stored_tokens()
            out[mode, moe, "verified"] = set(eng.parts.decoder.graphs.verified)  # buckets whose first replay passed
        if cp <= 2:
            out["refused", mode] = _refuse_at_context(_engine(folders["v4-short"], group, mode))
            bf16 = _engine(folders["v4-unscored"], group, mode, "tp", "bfloat16")
            out["bfloat16", mode] = {path: greedy(bf16, _prompts(), NEW, path == "eager") for path in ("eager", "graph")}
    return out


@pytest.fixture(scope="module")
def runs(folders):
    return {1: [_job(CPGroup(), folders, 1)], 2: launch(_job, 2, folders, 2)}


@pytest.fixture(scope="module")
def reference(folders, hf_model):
    """transformers' greedy generate of each prompt alone: tokens [R, NEW], logits [R, NEW, V]."""
    model = hf_model(folders["v4"], "float32")
    return hf_greedy(model, _prompts(), NEW)


def _check(per_rank: list[dict], reference, cp: int) -> None:
    ref_tokens, ref_logits = reference
    for mode in _modes(cp):
        for moe in ("ep", "tp") if cp == 2 else ("ep",):
            for rank, got in enumerate(per_rank):
                for path in ("eager", "graph"):
                    toks, logits, paths = got[mode, moe, path]
                    where = (cp, mode, moe, path, rank)
                    assert torch.equal(toks, ref_tokens), where
                    for i in range(NEW):
                        assert rel_err(logits[:, i], ref_logits[:, i]) <= TOL["float32"], (*where, i)
                    assert set(paths) == {path}, where
                steps = got[mode, moe, "steps"]
                moved = sum(s["bytes_merged"] for s in steps)
                assert (moved > 0) == (mode == "layer-split"), (mode, moe, moved)  # the owner's output broadcast
                assert got[mode, moe, "stored"] == 0
                # each bucket's first replay was self-checked (RuntimeConfig.verify_capture: on by default
                # on the CPU stand-in)
                replayed = {(s["bucket"], s["pages"]) for s in steps if s["path"] == "graph"}
                assert replayed and got[mode, moe, "verified"] == replayed, (mode, moe)


def test_v4_decoding_matches_transformers_at_cp_1(runs, reference):
    _check(runs[1], reference, 1)


def test_v4_decoding_matches_transformers_at_cp_2(runs, reference):
    _check(runs[2], reference, 2)
    for got in runs[2][1:]:  # every rank returns the same logits
        assert torch.equal(got["layer-split", "tp", "graph"][1], runs[2][0]["layer-split", "tp", "graph"][1])


@pytest.mark.slow
def test_v4_decoding_matches_transformers_at_cp_4(folders, reference):
    _check(launch(_job, 4, folders, 4), reference, 4)


def test_a_v4_conversation_matches_transformers_on_the_whole_sequence(runs, folders, hf_model):
    hf = hf_model(folders["v4"], "float32")
    for mode in _modes(2):
        for got in runs[2]:
            seqs, logits, _, total = got[mode, "conversation"]
            for j in range(2):
                with torch.inference_mode():
                    ref = hf(input_ids=torch.tensor(seqs[j]).view(1, -1)).logits[0].float()
                assert logits[j].shape == ref.shape and rel_err(logits[j], ref) <= TOL["float32"], (mode, j)
            assert total == [len(s) for s in seqs]


def test_bfloat16_decoding_matches_transformers_on_the_same_sequence(runs, folders, hf_model):
    model = hf_model(folders["v4-unscored"], "bfloat16")
    for cp in (1, 2):
        for mode in _modes(cp):
            for path in ("eager", "graph"):
                toks, logits, _ = runs[cp][0]["bfloat16", mode][path]
                for j, p in enumerate(_prompts()):
                    seq = torch.cat([torch.from_numpy(p), toks[j, :-1]]).view(1, -1)
                    with torch.inference_mode():
                        ref = model(input_ids=seq).logits[0, len(p) - 1:].float()
                    assert rel_err(logits[j], ref) <= TOL["bfloat16"], (cp, mode, path, j)


def test_a_step_at_the_context_limit_is_one_line_and_changes_nothing(runs):
    for cp in (1, 2):
        for mode in _modes(cp):
            for got in runs[cp]:
                assert got["refused", mode] == ("decode: request 0 holds 40 tokens, the model's context of 40: no "
                                                "position is left for another")


def test_graphcp_generate_matches_transformers(tmp_path, capsys, folders, reference):
    """``graphcp generate --cp 2 --kv-cache layer-split``: transformers' greedy ids."""
    case = "v4"
    rows = tmp_path / "r.jsonl"
    rows.write_text("".join(json.dumps({"tokens": p.tolist()}) + "\n" for p in _prompts()))
    out = tmp_path / "out.pt"
    argv = ["generate", "--model", str(folders[case]), "--input", str(rows), "--output", str(out), "--max-new-tokens",
            str(NEW), "--cp", "2", "--kv-cache", "layer-split", "--kv-tokens", "2048", "--page-size", str(PAGE)]
    assert main(argv) == 0, capsys.readouterr().err
    assert "layer-split KV cache, decode path graph" in capsys.readouterr().out
    assert torch.load(out)["tokens"] == [[t.tolist()] for t in reference[0]]


def test_short_requests_on_pages_smaller_than_a_block(folders, hf_model):
    """Pages of 4 tokens (an HCA block of 8 spans two), requests of 2 and 3 tokens: the
    first decode buckets hold fewer tokens than a block (their pooling reads and writes
    nothing it should not); eager and on the graphs, transformers' ids and logits."""
    model = hf_model(folders["v4"], "float32")
    # (prompts whose greedy continuation never picks token 1, the EOS min_new_tokens keeps transformers from)
    prompts = [np.array([7, 300]), np.array([11, 5, 402])]
    steps = 12
    want = []
    for p in prompts:
        with torch.inference_mode():
            g = model.generate(torch.from_numpy(p).view(1, -1), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=steps, min_new_tokens=steps, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0)
        want.append((g.sequences[0, len(p):], torch.stack([x[0].float() for x in g.logits])))
    eng = PrefillEngine(folders["v4"], RuntimeConfig(kv_tokens=512, graph="breakable", page_size=4))
    for path in ("eager", "graph"):
        toks, logits, paths = greedy(eng, prompts, steps, path == "eager")
        assert set(paths) == {path}
        for j, (t, lg) in enumerate(want):
            assert torch.equal(toks[j], t) and rel_err(logits[j], lg) <= TOL["float32"], (path, j)
    pages = {s["pages"] for s in eng.stats()["decode_steps"] if s["path"] == "graph"}
    assert 1 in pages and max(pages) >= 4  # a bucket of one page (4 tokens) and wider ones


def _export_after_decoding(group, folder, path: str, prompt: np.ndarray, steps: int) -> list[int]:
    """A prefill, ``steps`` greedy decode steps on the decode graphs (layer-split cache),
    then the request's KV exported to rank 0 and written to ``path``: the sequence cached."""
    eng = _engine(folder, group, "layer-split")
    o = eng.prefill([Request(prompt)])
    handles, tok, seq = o.handles, o.last_logits.argmax(-1), prompt.tolist()
    for _ in range(steps):
        seq.append(int(tok[0]))
        o = eng.decode(handles, tok, logits=True)
        assert o.info.path == "graph"
        handles, tok = o.handles, o.logits.argmax(-1)
    export = eng.export_kv(handles[0], dst=0)
    if export is not None:
        export.token_ids = torch.tensor(seq)
        save_kv(export, path)
    eng.release(handles[0])
    return seq


def test_transformers_continues_from_the_kv_exported_after_decoding(folders, hf_model, tmp_path):
    """The cache the decode steps wrote (CP 2, layer-split, graphs), exported and loaded as
    transformers' cache: its logits for more tokens equal transformers' on the whole sequence."""
    path = str(tmp_path / "kv.safetensors")
    seq = launch(_export_after_decoding, 2, folders["v4"], path, _prompts()[1], 9)[0]
    loaded = load_kv(path)
    assert loaded.num_tokens == len(seq) == len(_prompts()[1]) + 9
    model = hf_model(folders["v4"], "float32")
    more = torch.tensor([[3, 77, 410, 9, 250]])
    with torch.inference_mode():
        full = model(input_ids=torch.cat([torch.tensor([seq]), more], dim=1)).logits[0, -more.shape[1]:]
        cont = model(input_ids=more, use_cache=True, **{cache_argument(model): loaded.cache}).logits[0]
    assert rel_err(cont, full) < TOL["float32"]
