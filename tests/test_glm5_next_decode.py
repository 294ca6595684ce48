"""Decode of GLM-5-Next's text model against transformers (docs/glm5_next.md "Decode"),
on tests/test_glm5_next.py's GLM_TINY: greedy decoding of requests of 30, 7 and 1 tokens
(a prefill, then one step a token: each KDA layer's states advanced a token, each indexed
layer's latent and indexer rows stored and its row attending over its pooled selection:
the long request's steps see more than index_topk + kpool - 1 tokens, so they select)
gives transformers' greedy ``generate``'s ids for 16 new tokens and every step's logits
within 1e-4, eagerly and on the decode graphs (``PooledDecode``), at CP 2 on each cache
mode the family runs (replicated with ``--moe ep``, layer-split with ``tp``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import hf_greedy, rel_err
from test_decode import greedy
from test_glm5_next import glm_model, save_folders

from graphcp import PrefillEngine, RuntimeConfig
from graphcp.dist import launch

NEW = 16
LENS = (30, 7, 1)
CASES = (("replicated", "ep"), ("layer-split", "tp"))


def _prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 500, n) for n in LENS]


def _job(group, folder) -> dict:
    out = {}
    for mode, moe in CASES:
        engine = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, kv_cache=mode, graph="breakable", page_size=16,
                                                     moe=moe), group)
        for path in ("eager", "graph"):
            out[mode, path] = greedy(engine, _prompts(), NEW, path == "eager")
        out[mode, "stored"] = engine.parts.kv.stored_tokens()
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_folders(tmp_path_factory)["float32"]


def test_greedy_decoding_matches_transformers_generate_at_cp2(folder):
    ref_tokens, ref_logits = hf_greedy(glm_model(folder), _prompts(), NEW)
    runs = launch(_job, 2, folder)
    for rank, got in enumerate(runs):
        for mode, _ in CASES:
            for path in ("eager", "graph"):
                toks, logits, paths = got[mode, path]
                where = (mode, path, rank)
                assert torch.equal(toks, ref_tokens), where
                for i in range(NEW):
                    assert rel_err(logits[:, i], ref_logits[:, i]) <= 1e-4, (*where, i)
                assert set(paths) == {path}, where
            assert got[mode, "stored"] == 0, (mode, rank)
