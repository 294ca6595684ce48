"""Kimi Linear on the mesh's other axes against the single-rank engine (docs/kimi_linear.md
"What combines"), on tests/conftest.py's KIMI_TINY at 2 ranks, float32 and bfloat16:

- pipeline stages (``pp_size=2``: the KDA and MLA layers split over two stages, each
  stage's KDA states and MLA rows in its own cache);
- attention DP (``dp_size=2``: the requests split over two replicas, each with its own
  states and latent rows, the MoE over both ranks), with MoE ``ep`` and ``tp``;

a batch of requests of 1 to 130 tokens, then a request continued after its prefix (the
KDA states carried over): every token's logits within 1e-5 (float32) or 2e-2 (bfloat16)
of one rank's, on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import rel_err

from graphcp import ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch

LENS = (1, 7, 45, 130)
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
#: (ParallelConfig, RuntimeConfig.moe)
MESHES = ((dict(pp_size=2), "ep"), (dict(dp_size=2), "ep"), (dict(dp_size=2), "tp"))
ALL_EXPERTS = dict(num_experts_per_tok=8, n_group=1)


def _tokens() -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, 512, n) for n in LENS]


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return {"float32": hf_model_dir("kimi_linear"), "bfloat16": hf_model_dir("kimi_linear", **ALL_EXPERTS)}


def _run(engine: PrefillEngine) -> list[torch.Tensor]:
    """Every token's logits of the batch, then of the longest request's continuation."""
    toks = _tokens()
    one = engine.prefill([Request(t[:-20] if len(t) > 20 else t) for t in toks], all_logits=True)
    more = engine.prefill([Request(toks[-1][-20:], one.handles[-1])], all_logits=True)
    for h in one.handles[:-1] + more.handles:
        engine.release(h)
    return [x.float() for x in one.logits + more.logits]


def _job(group, folders: dict) -> dict:
    out = {}
    for dtype, folder in folders.items():
        for par, moe in MESHES:
            engine = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=1024, moe=moe), group, None,
                                   ParallelConfig(**par))
            out[dtype, str(par), moe] = _run(engine)
    return out


def test_pipeline_stages_and_attention_dp_equal_one_rank(folders):
    ranks = launch(_job, 2, folders)
    for dtype, folder in folders.items():
        want = _run(PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=1024)))
        for rank, got in enumerate(ranks):
            for par, moe in MESHES:
                for i, (g, w) in enumerate(zip(got[dtype, str(par), moe], want, strict=True)):
                    assert rel_err(g, w) <= TOL[dtype], (dtype, par, moe, rank, i)
