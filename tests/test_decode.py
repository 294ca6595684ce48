"""Decode over every cache mode against transformers (issue 40, docs/decode.md).

Greedy decoding of a batch of requests of different lengths (a prefill, then one decode
step a new token) must give transformers' greedy ``generate``'s token ids for 32 new
tokens and each step's logits within 1e-4 relative (float32), at CP 1, 2 and 4 on the
replicated, token-sharded and layer-split caches, eagerly and on the decode graphs;
bfloat16 within the suite's 2e-2 against transformers in bfloat16 on the same sequence.
A conversation (prompt, 8 generated, a second prompt, 8 generated, a third) prefills each
turn after the decoded tokens and matches transformers on the whole sequence, and the
token-sharded cache's ranks stay within a page of 1/C of each request.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import rel_err

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.dist import CPGroup, launch

MODES = ("replicated", "sharded", "layer-split")
LENS = (7, 29, 1)  # a batch of requests of different lengths (one shorter than 2C)
NEW = 32
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
TURNS = ((11, 3), (6, 17), (9, 2))  # per turn, each request's new prompt tokens
TURN_NEW = 8
PAGE = 16


def _prompts(vocab: int, lens=LENS, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n) for n in lens]


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return {dtype: hf_model_dir("qwen3", False, dtype) for dtype in ("float32", "bfloat16")}


@pytest.fixture(scope="module")
def reference(folders, hf_model):
    """transformers' greedy generate of each prompt alone: tokens [R, NEW], logits [R, NEW, V]."""
    model = hf_model(folders["float32"], "float32")
    toks, logits = [], []
    for p in _prompts(model.config.vocab_size):
        with torch.inference_mode():
            # (an explicit mask: without one, generate masks prompt tokens equal to pad_token_id)
            g = model.generate(torch.from_numpy(p).view(1, -1), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0)
        toks.append(g.sequences[0, len(p):])
        logits.append(torch.stack([x[0].float() for x in g.logits]))
    return torch.stack(toks), torch.stack(logits)


def greedy(engine: PrefillEngine, prompts, steps: int, force_eager: bool):
    """Prefill, then ``steps - 1`` decode steps feeding back the greedy token: tokens [R,
    steps], logits [R, steps, V], each step's path; the KV released."""
    out = engine.prefill([Request(p) for p in prompts], force_eager=True)
    handles, logits = out.handles, [out.last_logits]
    toks, paths = [out.last_logits.argmax(-1)], []
    for _ in range(steps - 1):
        o = engine.decode(handles, toks[-1], force_eager=force_eager, logits=True)
        handles, paths = o.handles, paths + [o.info.path]
        logits.append(o.logits)
        toks.append(torch.from_numpy(o.tokens))
        assert torch.equal(toks[-1], o.logits.argmax(-1))  # the device's choice is the logits' argmax
    for h in handles:
        engine.release(h)
    return torch.stack(toks, 1), torch.stack(logits, 1), paths


def conversation(engine: PrefillEngine, vocab: int):
    """Two requests through three turns: each turn's prompt prefilled after the decoded
    tokens (the last generated token, not yet cached, first), then TURN_NEW greedy tokens.
    Each request's whole token sequence, the logits at each of its positions but the last
    prompt's (every new token's of a prefill, each decode step's), the handles' per-rank
    tokens after every turn."""
    rng = np.random.default_rng(11)
    handles, last = [None, None], [None, None]
    seqs, logits, held = [[], []], [[], []], []
    for lens in TURNS:
        reqs = []
        for j, n in enumerate(lens):
            new = rng.integers(0, vocab, n)
            new = new if last[j] is None else np.concatenate([[last[j]], new])
            seqs[j] += new.tolist()
            reqs.append(Request(new, handles[j]))
        out = engine.prefill(reqs, all_logits=True, force_eager=True)
        handles, tok = out.handles, out.last_logits.argmax(-1)
        for j in range(2):
            logits[j].append(out.logits[j])
        for _ in range(TURN_NEW - 1):
            o = engine.decode(handles, tok, logits=True)
            for j in range(2):
                seqs[j].append(int(tok[j]))
                logits[j].append(o.logits[j : j + 1])
            handles, tok = o.handles, o.logits.argmax(-1)
        last = tok.tolist()
        held.append([tuple(h.local_tokens(r) for r in range(engine.parts.kv.cp_size)) for h in handles])
    for h in handles:
        engine.release(h)
    return seqs, [torch.cat(x) for x in logits], held, [h.num_tokens for h in handles]


def _engine(folder, group, mode: str, dtype: str = "float32") -> PrefillEngine:
    return PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=1024, kv_cache=mode, graph="breakable",
                                               page_size=PAGE), group)


def _job(group, folders: dict, cp: int) -> dict:
    """Every cache mode, eager and on the graphs; at CP 4 the sharded conversation; at
    CP 2 bfloat16 and every mode's conversation."""
    out = {}
    vocab = 512
    for mode in MODES:
        engine = _engine(folders["float32"], group, mode)
        for path in ("eager", "graph"):
            out[mode, path] = greedy(engine, _prompts(vocab), NEW, path == "eager")
        if cp == 4 and mode == "sharded" or cp == 2:
            out[mode, "conversation"] = conversation(engine, vocab)
        if cp == 2 and mode != "layer-split":
            bf16 = _engine(folders["bfloat16"], group, mode, "bfloat16")
            out[mode, "bfloat16"] = greedy(bf16, _prompts(vocab), NEW, False)
        out[mode, "stored"] = engine.parts.kv.stored_tokens()
        out[mode, "steps"] = engine.stats()["decode_steps"]
    return out


@pytest.fixture(scope="module")
def runs(folders):
    """cp -> every rank's results of :func:`_job`."""
    return {1: [_job(CPGroup(), folders, 1)], **{cp: launch(_job, cp, folders, cp) for cp in (2, 4)}}


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_greedy_decoding_matches_transformers_generate(runs, reference, cp, mode):
    ref_tokens, ref_logits = reference
    for rank, got in enumerate(runs[cp]):
        for path in ("eager", "graph"):
            toks, logits, paths = got[mode, path]
            where = (cp, mode, path, rank)
            assert torch.equal(toks, ref_tokens), where
            for i in range(NEW):
                assert rel_err(logits[:, i], ref_logits[:, i]) <= TOL["float32"], (*where, i)
            assert set(paths) == {path}, where  # a graph engine's steps replay (3 requests: bucket 4)
        assert got[mode, "stored"] == 0, (mode, rank)  # every handle released
        graph_steps = [s for s in got[mode, "steps"] if s["path"] == "graph"]
        # the smallest bucket that holds the step (3 requests: 4; a conversation's 2: 2), one launch
        assert graph_steps and all(s["bucket"] == {3: 4, 2: 2}[s["rows"]] and s["launches"] == 1 for s in graph_steps)
        merges = {s["decode_merge"] for s in got[mode, "steps"]}
        assert merges <= ({"all-gather", "all-to-all"} if mode == "sharded" else {"local"}), merges
        # what the ranks exchanged: nothing over a replicated cache or at CP 1
        moved = sum(s["bytes_merged"] for s in got[mode, "steps"])
        assert (moved > 0) == (cp > 1 and mode != "replicated"), (cp, mode, moved)
    # every rank returns the same logits
    for got in runs[cp][1:]:
        assert torch.equal(got[mode, "eager"][1], runs[cp][0][mode, "eager"][1])


@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_bfloat16_decoding_matches_transformers_on_the_same_sequence(runs, folders, hf_model, mode):
    model = hf_model(folders["bfloat16"], "bfloat16")
    toks, logits, _ = runs[2][0][mode, "bfloat16"]
    for j, p in enumerate(_prompts(512)):
        seq = torch.cat([torch.from_numpy(p), toks[j, :-1]]).view(1, -1)
        with torch.inference_mode():
            ref = model(input_ids=seq).logits[0, len(p) - 1 :].float()
        assert rel_err(logits[j], ref) <= TOL["bfloat16"], j


def _check_conversation(result, hf) -> None:
    seqs, logits, held, total = result
    for j in range(2):
        with torch.inference_mode():
            ref = hf(input_ids=torch.tensor(seqs[j]).view(1, -1)).logits[0].float()
        assert logits[j].shape == ref.shape and rel_err(logits[j], ref) <= TOL["float32"], j
    assert total == [len(s) for s in seqs]  # the last generated token is not cached yet


@pytest.mark.parametrize("cp", [2, 4])
def test_a_conversation_extends_the_decoded_tokens_exactly(runs, folders, hf_model, cp):
    hf = hf_model(folders["float32"], "float32")
    for mode in MODES if cp == 2 else ("sharded",):
        for got in runs[cp]:
            _check_conversation(got[mode, "conversation"], hf)
    # the token-sharded cache: every rank within a page of 1/C of each request, every turn
    # (the ledger, which every rank keeps the same)
    held = [r["sharded", "conversation"][2] for r in runs[cp]]
    assert all(h == held[0] for h in held)
    for turn in held[0]:
        for per_rank in turn:
            share = sum(per_rank) / cp
            assert max(abs(k - share) for k in per_rank) <= PAGE, per_rank
