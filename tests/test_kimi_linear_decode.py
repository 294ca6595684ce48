"""Decode of Kimi Linear against transformers (issue 48, docs/kimi_linear.md "Decode"), on
tests/conftest.py's KIMI_TINY (KDA layers, an MLA layer with no RoPE, DeepSeek's MoE):

- greedy decoding of a batch of requests of different lengths (a prefill, then one step a
  token: each KDA layer's conv and recurrent states advanced a token, each MLA layer's
  latent row stored and attended) gives transformers' greedy ``generate``'s ids for 16 new
  tokens and every step's logits within 1e-4 (float32), eagerly and on the decode graphs,
  at CP 2 on each cache mode the family runs (replicated with ``--moe ep``, layer-split
  with ``tp``); every rank the same logits;
- a three-turn conversation (each turn prefilled after the decoded tokens: the scan
  starts from the decoded states) matches transformers on the whole sequence;
- bfloat16 within 2e-2 of transformers in bfloat16 on the same sequence, and of
  graphcp's own bfloat16 prefill of it (a bfloat16 checkpoint of the all-experts twin:
  a router near-tie flips an expert under bfloat16 rounding).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import hf_greedy, rel_err
from test_decode import _check_conversation, conversation, greedy

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch

NEW = 16
LENS = (7, 29, 1)
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
#: (cache mode, RuntimeConfig.moe): each cache mode the family runs
CASES = (("replicated", "ep"), ("layer-split", "tp"))
ALL_EXPERTS = dict(num_experts_per_tok=8, n_group=1)


def _prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 512, n) for n in LENS]


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return {"float32": hf_model_dir("kimi_linear"), "bfloat16": hf_model_dir("kimi_linear", False, "bfloat16",
                                                                           **ALL_EXPERTS)}


def _engine(folder, group, mode: str, moe: str, dtype: str = "float32") -> PrefillEngine:
    return PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=1024, kv_cache=mode, graph="breakable",
                                               page_size=16, moe=moe), group)


def _job(group, folders: dict) -> dict:
    out = {}
    for mode, moe in CASES:
        engine = _engine(folders["float32"], group, mode, moe)
        for path in ("eager", "graph"):
            out[mode, path] = greedy(engine, _prompts(), NEW, path == "eager")
        out[mode, "conversation"] = conversation(engine, 512)
        out[mode, "stored"] = engine.parts.kv.stored_tokens()
        out[mode, "steps"] = engine.stats()["decode_steps"]
    engine = _engine(folders["bfloat16"], group, "replicated", "ep", "bfloat16")
    out["bfloat16"] = toks, _, _ = greedy(engine, _prompts(), NEW, False)
    own = []  # graphcp's bfloat16 prefill of each decoded sequence: the logits at the steps' positions
    for j, p in enumerate(_prompts()):
        seq = np.concatenate([p, toks[j, :-1].numpy()])
        prefill = engine.prefill([Request(seq)], all_logits=True)
        own.append(prefill.logits[0][len(p) - 1:].float())
        engine.release(prefill.handles[0])
    out["bfloat16 prefill"] = own
    return out


@pytest.fixture(scope="module")
def runs(folders) -> list[dict]:
    return launch(_job, 2, folders)


def test_greedy_decoding_matches_transformers_generate_at_cp2(runs, folders, hf_model):
    ref_tokens, ref_logits = hf_greedy(hf_model(folders["float32"], "float32"), _prompts(), NEW)
    for rank, got in enumerate(runs):
        for mode, _ in CASES:
            for path in ("eager", "graph"):
                toks, logits, paths = got[mode, path]
                where = (mode, path, rank)
                assert torch.equal(toks, ref_tokens), where
                for i in range(NEW):
                    assert rel_err(logits[:, i], ref_logits[:, i]) <= TOL["float32"], (*where, i)
                assert set(paths) == {path}, where
            assert got[mode, "stored"] == 0, (mode, rank)  # every handle released
            graph = [s for s in got[mode, "steps"] if s["path"] == "graph"]
            assert graph and {s["linear_kernels"] for s in got[mode, "steps"]} == {"torch"}, mode
            assert torch.equal(got[mode, "eager"][1], runs[0][mode, "eager"][1]), (mode, rank)


def test_a_conversation_scans_each_turn_from_the_decoded_states(runs, folders, hf_model):
    hf = hf_model(folders["float32"], "float32")
    for got in runs:
        for mode, _ in CASES:
            _check_conversation(got[mode, "conversation"], hf)


def test_bfloat16_decoding_matches_transformers_on_the_same_sequence(runs, folders, hf_model):
    """Each request's steps within 2e-2 of transformers' bfloat16 on the same sequence, and
    of graphcp's own bfloat16 prefill of it (the scan's chunked form vs the steps)."""
    model = hf_model(folders["bfloat16"], "bfloat16")
    toks, logits, _ = runs[0]["bfloat16"]
    for j, p in enumerate(_prompts()):
        seq = torch.cat([torch.from_numpy(p), toks[j, :-1]]).view(1, -1)
        with torch.inference_mode():
            ref = model(input_ids=seq).logits[0, len(p) - 1:].float()
        assert rel_err(logits[j], ref) <= TOL["bfloat16"], j
        assert rel_err(logits[j], runs[0]["bfloat16 prefill"][j]) <= TOL["bfloat16"], j
