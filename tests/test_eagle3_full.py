"""An EAGLE-3 draft under ``graph='full'`` (the replicated cache, zigzag, the triton
kernel under the Triton interpreter on CPU): the draft's graph captures its attention
too; at CP 2 with a cached prefix its logits at every new position equal the
plain-torch reference, float32 and bfloat16, and a replay equals the same-bucket eager
draft bitwise."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from eagle3_ref import eagle3_reference, shifted, target_states, write_draft, write_target  # noqa: E402
from helpers import rel_err  # noqa: E402

from graphcp import PrefillEngine, Request, RuntimeConfig  # noqa: E402
from graphcp.dist import launch  # noqa: E402
from graphcp.model.eagle3.shift import draft_input_ids  # noqa: E402
from graphcp.runtime.capture.buckets import BucketSet  # noqa: E402
from graphcp.runtime.engine import prefill_after_prefixes  # noqa: E402

LENS, PREFIX = [21, 1, 8], [0, 0, 11]
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _batch():
    rng = np.random.default_rng(4)
    return [(rng.integers(0, 512, p) if p else None, rng.integers(0, 512, n)) for n, p in zip(LENS, PREFIX)]


def _job(group, target, draft):
    out = []
    for dtype in TOL:
        rt = RuntimeConfig(dtype=dtype, graph="full", attention="triton", kv_tokens=1024, max_requests=4,
                           verify_capture=False, draft=draft)
        eng = PrefillEngine(target, rt, group, BucketSet((16, 32), padding_factor=16.0))
        res = prefill_after_prefixes(eng, _batch(), all_logits=True)
        prep = eng.parts.preparer.prepare([Request(np.arange(20)), Request(np.arange(3) + 9)])
        try:  # the draft's replay after the target's, against the same draft eagerly on the bucket
            cap = eng.parts.runner.select(prep.plan.max_local_rows).capacity
            eng.parts.runner.try_replay(prep)
            ids = draft_input_ids(np.concatenate([np.arange(20), np.arange(3) + 9]), prep.plan.extend_lens,
                                  np.array([1, 2]), prep.plan.rank(eng.rank).rows)
            want = [t.clone() for t in eng.parts.drafter.graphs.eager_on_bucket(prep, cap, ids)]
            got = eng.parts.drafter.graphs.replay(prep, cap, ids, {})
            graph = eng.parts.drafter.graphs.graphs[cap][0]
            bitwise = all(torch.equal(a, b) for a, b in zip(got, want)) and len(graph.breaks) == 0
        finally:
            eng.parts.preparer.abort(prep)
        out.append((res.draft, res.info.path, bitwise))
    return out


def test_full_graph_draft_equals_the_reference(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    target, draft = str(write_target(tmp_path / "target")), str(write_draft(tmp_path / "draft"))
    w = load_file(f"{draft}/model.safetensors")
    full = [np.concatenate([p, n]) if p is not None else n for p, n in _batch()]
    for rank, per_dtype in enumerate(launch(_job, 2, target, draft)):
        for dtype, (d, path, bitwise) in zip(TOL, per_dtype):
            where = f"rank {rank}, {dtype}"
            assert path == "graph" and bitwise, where
            hf = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
            embed = hf.model.embed_tokens.weight.detach()
            for j, n in enumerate(LENS):
                h3, _ = target_states(hf, full[j])
                want, _, _ = eagle3_reference(w, embed, h3, shifted(full[j], int(d.next_tokens[j])))
                assert rel_err(d.all_logits[j], want[-n:]) <= TOL[dtype], f"{where}, request {j}"
