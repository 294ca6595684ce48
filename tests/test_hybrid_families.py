"""The other hybrids against transformers (docs/hybrid.md): Qwen3.5-MoE
(``Qwen3_5MoeForCausalLM``: a MoE with a gated shared expert in every layer), Qwen3-Next
(``Qwen3NextForCausalLM``: projections packed per key head, layer 1 dense) and the text
model of the multimodal Qwen3.5 checkpoint (``Qwen3_5ForConditionalGeneration``, its
vision tower skipped). Requests of 1 to 300 tokens in one batch and a chunked
continuation, float32 at 1e-4 at CP 1, 2 and 4, ``--moe ep`` and ``tp``, graphs off and
breakable; bfloat16 within 2e-2 on the MoE models' all-experts twins (a router near-tie
flips an expert under bfloat16 rounding, as tests/test_moe_parity.py says).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import save_cases
from test_hybrid import check_logits, reference_logits

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch
from graphcp.runtime.capture.buckets import BucketSet

LENS = [1, 7, 45, 300]
SPLIT = 111  # the long request's cached prefix (inside a zigzag block at CP 2 and 4)
BUCKETS = BucketSet((64, 256), padding_factor=64.0)
CASES = {"moe": ("qwen3_5_moe_text", {}), "moe-all": ("qwen3_5_moe_text", dict(num_experts_per_tok=8)),
         "next": ("qwen3_next", {}), "next-all": ("qwen3_next", dict(num_experts_per_tok=8)),
         "vl": ("qwen3_5", {})}
#: CP size -> (case, dtype, moe, graph) runs
RUNS = {
    2: [("moe", "float32", "ep", "off"), ("moe", "float32", "tp", "breakable"), ("moe-all", "bfloat16", "ep", "off"),
        ("next", "float32", "tp", "off"), ("next", "float32", "ep", "breakable"),
        ("next-all", "bfloat16", "tp", "breakable"), ("vl", "float32", "ep", "off")],
    4: [("moe", "float32", "tp", "off"), ("next", "float32", "ep", "off"), ("vl", "float32", "ep", "breakable")],
}


def _tokens():
    rng = np.random.default_rng(11)
    return [rng.integers(0, 512, n) for n in LENS]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_cases(tmp_path_factory, CASES, seed=2)


@pytest.fixture(scope="module")
def reference(folders, hf_model):
    """transformers' logits per case (the multimodal model as itself, on text alone)."""
    from transformers import Qwen3_5ForConditionalGeneration

    def multimodal(folder, dtype):
        return Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()

    return {case: reference_logits(hf_model, folder, _tokens(), multimodal if case == "vl" else None)
            for case, folder in folders.items()}


def _run(eng: PrefillEngine):
    toks = _tokens()
    one = eng.prefill([Request(t) for t in toks], all_logits=True)
    for h in one.handles:
        eng.release(h)
    head = eng.prefill([Request(toks[3][:SPLIT])], all_logits=True)
    tail = eng.prefill([Request(toks[3][SPLIT:], head.handles[0])], all_logits=True)
    eng.release(tail.handles[0])
    paths = {one.info.path, head.info.path, tail.info.path}
    return [x.clone() for x in one.logits], torch.cat([head.logits[0], tail.logits[0]]), paths


def _job(group, folders, runs):
    out = []
    for case, dtype, moe, graph in runs:
        rt = RuntimeConfig(dtype=dtype, moe=moe, graph=graph, kv_tokens=2048)
        res = _run(PrefillEngine(folders[case], rt, group, BUCKETS))
        out.append(res if group.rank == 0 else None)
    return out


def _check(case: str, dtype: str, one, chunked, reference, where) -> None:
    ref = reference[case][dtype]
    check_logits(one, ref, dtype, where)
    check_logits([chunked], [ref[3]], dtype, where)


@pytest.mark.parametrize("case", ["moe", "next", "vl"])
def test_one_rank_matches_transformers(folders, reference, case):
    one, chunked, _ = _run(PrefillEngine(folders[case], RuntimeConfig(kv_tokens=2048)))
    _check(case, "float32", one, chunked, reference, case)


@pytest.mark.parametrize("cp", sorted(RUNS))
def test_cp_matches_transformers(folders, reference, cp):
    results = launch(_job, cp, folders, RUNS[cp])[0]
    for (case, dtype, moe, graph), (one, chunked, paths) in zip(RUNS[cp], results):
        where = (cp, case, dtype, moe, graph)
        assert paths == {"graph" if graph != "off" else "eager"}, where
        _check(case, dtype, one, chunked, reference, where)
