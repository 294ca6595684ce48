"""``engine.generate`` and ``graphcp generate`` (issue 40, docs/decode.md): greedy tokens
as transformers' ``generate``, stop tokens, conversations prefilled after their generated
tokens, the OUT.pt file, the per-step stats, and bad input as one line (exit 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import rel_err

from graphcp import Conversation, PrefillEngine, Request, RuntimeConfig
from graphcp.cli.main import main
from graphcp.errors import BatchError

NEW = 12


@pytest.fixture(scope="module")
def folder(hf_model_dir):
    return hf_model_dir("qwen3", False, "float32")


@pytest.fixture(scope="module")
def engine(folder):
    return PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, graph="breakable"))


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, 512, n).tolist() for n in (9, 2, 31)]


@pytest.fixture(scope="module")
def reference(folder, hf_model):
    """transformers' greedy generate of each prompt alone: ids and logits per step."""
    model = hf_model(folder, "float32")
    out = []
    for p in _prompts():
        with torch.inference_mode():
            # (an explicit mask: without one, generate masks prompt tokens equal to pad_token_id)
            g = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                               output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        out.append((g.sequences[0, len(p):].tolist(), torch.stack([x[0] for x in g.logits])))
    return out


def test_generate_matches_transformers_and_keeps_every_step(engine, reference):
    reqs = [_prompts()[0], Request(_prompts()[1]), Conversation([_prompts()[2]])]
    out = engine.generate(reqs, NEW, logits=True)
    for j, (toks, logits) in enumerate(reference):
        assert out.tokens[j] == [toks] and out.finish[j] == ["length"], j
        assert rel_err(out.logits[j][0], logits) <= 1e-4, j
    assert out.steps == NEW - 1 and out.handles is None and engine.parts.kv.stored_tokens() == 0
    steps = engine.stats()["decode_steps"][-out.steps:]
    assert [s["rows"] for s in steps] == [3] * (NEW - 1) and {s["path"] for s in steps} == {"graph"}


def test_a_stop_token_ends_a_turn_and_is_kept(engine, reference):
    toks = reference[0][0]
    stop = toks[4]
    first = toks.index(stop)
    out = engine.generate([_prompts()[0], _prompts()[1]], NEW, stop=[stop])
    assert out.tokens[0] == [toks[: first + 1]] and out.finish[0] == ["stop"]
    other = reference[1][0]
    cut = other.index(stop) + 1 if stop in other else NEW
    assert out.tokens[1] == [other[:cut]]


def test_a_conversation_continues_after_its_generated_tokens(engine, hf_model, folder):
    turns = [[5, 6, 7, 8], [9, 10], [11]]
    out = engine.generate([Conversation(turns, 4), _prompts()[0]], 6, logits=True, release=False)
    try:
        assert [len(t) for t in out.tokens[0]] == [4, 4, 4] and [len(t) for t in out.tokens[1]] == [6]
        seq = []
        for t, gen in zip(turns, out.tokens[0]):
            seq += t + gen
        h = out.handles[0]
        assert h.num_tokens == len(seq) - 1  # the last generated token is not cached yet
        with torch.inference_mode():
            ref = hf_model(folder, "float32")(input_ids=torch.tensor([seq])).logits[0]
        at = np.cumsum([len(t) + len(g) for t, g in zip(turns, out.tokens[0])])
        for k, (t, gen) in enumerate(zip(turns, out.tokens[0])):
            start = (at[k - 1] if k else 0) + len(t) - 1  # the turn's last prompt position
            assert rel_err(out.logits[0][k], ref[start : start + len(gen)]) <= 1e-4, k
        # the kept KV extends: the export holds every token, decoded ones included
        exp = engine.export_kv(h)
        assert exp.k[0].shape[1] == h.num_tokens
    finally:
        for h in out.handles:
            engine.release(h)


def test_a_request_extending_a_cached_prefix_generates_as_the_whole_prompt(engine, reference):
    p = _prompts()[2]
    h = engine.prefill([Request(p[:20])]).handles[0]
    out = engine.generate([Request(p[20:], h)], NEW)
    assert out.tokens == [[reference[2][0]]] and engine.parts.kv.stored_tokens() == 0  # the extended KV released


def test_generate_refuses_bad_requests_before_any_forward(engine):
    snap = engine.parts.kv.snapshot()
    cases = [([[1, 512]], "generate: request 0, turn 0, position 1: token id 512"),
             ([Conversation([])], "request 0: turns must be a non-empty list"),
             ([Conversation([[], [1]])], "request 0: turn 0 is empty"),
             ([[1, 2], Conversation([[1] * 4000, [2]], 100)],
              "request 1: 4001 cached and prompt tokens and up to 2 x 100"),
             ([], "non-empty list")]
    for reqs, match in cases:
        with pytest.raises(BatchError, match=match):
            engine.generate(reqs, 5)
    with pytest.raises(BatchError, match="max_new_tokens"):
        engine.generate([[1]], 0)
    assert engine.parts.kv.snapshot() == snap


# ---- graphcp generate ------------------------------------------------------------------
def _lines(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_command_writes_tokens_logits_and_stats(tmp_path, capsys, folder, engine):
    rows = [{"tokens": _prompts()[0], "prefix": 4}, {"turns": [[5, 6, 7, 8], [9, 10], [11]], "max_new_tokens": 4}]
    out, stats = tmp_path / "out.pt", tmp_path / "stats.json"
    argv = ["generate", "--model", str(folder), "--input", _lines(tmp_path / "r.jsonl", rows), "--output", str(out),
            "--max-new-tokens", "6", "--save-logits", "--stats", str(stats), "--kv-tokens", "1024"]
    assert main(argv) == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "generated 18 tokens for 2 requests (4 turns)" in text and str(out) in text
    res = torch.load(out)
    want = engine.generate([_prompts()[0], Conversation(rows[1]["turns"], 4)], 6)
    assert res["tokens"] == want.tokens and res["finish"] == want.finish
    assert [[x.shape for x in r] for r in res["logits"]] == [[(6, 512)], [(4, 512)] * 3]
    assert all(x.dtype == torch.float32 for r in res["logits"] for x in r)
    steps = json.loads(stats.read_text())["ranks"][0]["decode_steps"]
    # turn 0: both requests (5 steps, the conversation's 3 among them), then its turns 1 and 2: 3 steps each
    assert [s["rows"] for s in steps] == [2, 2, 2, 1, 1] + [1] * 6
    assert all(s["path"] == "graph" and s["bucket"] == s["rows"] for s in steps)  # (--graph: breakable)


@pytest.mark.parametrize("rows,extra,match", [
    ([{"tokens": [1, 600]}], [], r"r.jsonl line 1, turn 0, position 1: token id 600 is outside the vocabulary"),
    ([{"turns": [[1], 2]}], [], r'r.jsonl line 1: "turns\[1\]" must be a list of integer ids'),
    ([{"turns": []}], [], r'"turns" must be a non-empty list'),
    ([{"turns": [[1]], "max_new_tokens": 0}], [], r'"max_new_tokens" must be an integer >= 1'),
    ([{"turns": [[1]], "temperature": 1}], [], r"unknown keys \['temperature'\]"),
    ([{"turns": [[1] * 4000, [2]]}], ["--max-new-tokens", "100"], r"line 1: 4001 prompt tokens and up to 2 x 100"),
    ([{"tokens": [1]}], ["--max-new-tokens", "0"], r"argument --max-new-tokens: expected an integer >= 1"),
    ([{"tokens": [1]}], ["--cp", "2", "--pp", "2"], r"--pp >1 with graphcp generate: .* not built yet; use --pp 1"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, folder, rows, extra, match):
    out = tmp_path / "out.pt"
    argv = ["generate", "--model", str(folder), "--input", _lines(tmp_path / "r.jsonl", rows), "--output", str(out),
            "--max-new-tokens", "3", *extra]
    try:
        code = main(argv)
    except SystemExit as e:  # a flag's own range is argparse's: exit 2 from the parser
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("graphcp generate: error: "), err
    assert __import__("re").search(match, err), err
    assert not out.exists()
