"""An EAGLE-3 draft on a mixture-of-experts target (Qwen3-MoE) at CP 2: the target's
experts split over the ranks (``moe="ep"``, graphs off and breakable) or sharded like
the dense MLP (``moe="tp"``), every cache mode; the draft's logits at every new position
equal the plain-torch reference fed transformers' hidden states. float32 runs top-4 of
8 experts; bfloat16 the all-experts twin (top-8: a near-tie in the router flips an
expert under bfloat16 rounding, as in tests/test_moe_parity.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eagle3_ref import eagle3_reference, shifted, target_states, write_draft, write_moe_target
from helpers import rel_err

from graphcp import ParallelConfig, PrefillEngine, RuntimeConfig
from graphcp.dist import launch
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import prefill_after_prefixes

LENS, PREFIX = [29, 1, 12], [0, 0, 9]
TOL = {"float32": 1e-4, "bfloat16": 2e-2}  # transformers' MoE against graphcp's (tests/test_moe_parity.py)
TOP_K = {"float32": 4, "bfloat16": 8}
CASES = [("ep", "breakable", "float32", "replicated"), ("tp", "off", "float32", "sharded"),
         ("ep", "off", "bfloat16", "layer-split"), ("tp", "off", "bfloat16", "replicated")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3moe")
    return ({d: str(write_moe_target(root / f"moe{k}", k)) for d, k in TOP_K.items()}, str(write_draft(root / "draft")))


def _batch():
    rng = np.random.default_rng(9)
    return [(rng.integers(0, 512, p) if p else None, rng.integers(0, 512, n)) for n, p in zip(LENS, PREFIX)]


def _job(group, targets, draft):
    out = []
    for moe, graph, dtype, kv in CASES:
        rt = RuntimeConfig(dtype=dtype, graph=graph, kv_tokens=1024, kv_cache=kv, moe=moe, draft=draft)
        eng = PrefillEngine(targets[dtype], rt, group, BucketSet((16, 32, 64), padding_factor=64.0),
                            ParallelConfig(cp_size=2))
        res = prefill_after_prefixes(eng, _batch(), all_logits=True)
        out.append((res.draft, res.info.path))
    return out


def test_draft_on_a_moe_target_equals_the_reference(models):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    targets, draft = models
    w = load_file(f"{draft}/model.safetensors")
    hf = {d: AutoModelForCausalLM.from_pretrained(targets[d], dtype=getattr(torch, d)).eval() for d in TOL}
    full = [np.concatenate([p, n]) if p is not None else n for p, n in _batch()]
    states = {d: [target_states(hf[d], ids)[0] for ids in full] for d in TOL}
    for rank, per_case in enumerate(launch(_job, 2, targets, draft)):
        for (moe, graph, dtype, kv), (d, path) in zip(CASES, per_case):
            where = f"rank {rank}: moe={moe}, graph={graph}, {dtype}, {kv}"
            assert path == ("graph" if graph != "off" else "eager"), where
            embed = hf[dtype].model.embed_tokens.weight.detach()
            for j, n in enumerate(LENS):
                want, _, _ = eagle3_reference(w, embed, states[dtype][j], shifted(full[j], int(d.next_tokens[j])))
                assert rel_err(d.all_logits[j], want[-n:]) <= TOL[dtype], f"{where}, request {j}"
