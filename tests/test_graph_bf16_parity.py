"""bfloat16 on the default graph path (breakable graphs, the zigzag layout) against
transformers, for every family, checkpoints stored in float32 and in bfloat16, at
CP 1 and 2 (CP 4: one family stored each way, see CP4_CHECKPOINTS): the configuration
users run, and the one a replay that read stale capture-time casts got wrong by ~1.5
relative error while float32 stayed exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FAMILIES
from helpers import graph_then_eager, rel_err

from graphcp import PrefillEngine
from graphcp.config import RuntimeConfig
from graphcp.dist import CPGroup, launch
from graphcp.runtime.capture.buckets import BucketSet

#: transformers in bfloat16 vs graphcp in bfloat16 (as tests/test_hf_parity.py)
TOL_HF = 2e-2
#: the graph path (rows padded to the bucket) vs --graph off: bfloat16 rounding of the padded matmuls
TOL_EAGER = 2e-2
LENS = [1, 17, 150, 5]
PREFIX = 40  # request 2 extends a 40-token cached prefix
BUCKETS = BucketSet((16, 32, 64, 128, 256), padding_factor=64.0)
CHECKPOINTS = [(f, stored) for f in FAMILIES for stored in ("float32", "bfloat16")]
#: CP 4 (zigzag's 8 chunks, a 3-hop ring) on one family stored in each dtype: the casts a
#: replay reads do not depend on the CP size, and CP 2 runs every family (Llama: q/k/v,
#: o_proj and MLP biases, llama3 RoPE; Qwen3: q/k norms, head_dim != hidden / heads)
CP4_CHECKPOINTS = [("llama", "bfloat16"), ("qwen3", "float32")]


def _tokens(vocab: int):
    rng = np.random.default_rng(17)
    return [rng.integers(0, vocab, n) for n in LENS], rng.integers(0, vocab, PREFIX)


def _job(group, folders):
    """For each checkpoint: the batch on the graph path, then eagerly, in bfloat16."""
    out = []
    for folder in folders:
        eng = PrefillEngine(folder, RuntimeConfig(dtype="bfloat16", graph="breakable", kv_tokens=2048), group, BUCKETS)
        toks, prefix = _tokens(eng.cfg.vocab_size)
        outs = graph_then_eager(eng, toks, prefix, extends=2)
        out.append({path: (o.info.path, o.last_logits, o.logits) for path, o in outs.items()})
    return out


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_bf16_graph_path_matches_transformers_and_eager(cp, hf_model_dir, hf_model):
    checkpoints = CP4_CHECKPOINTS if cp == 4 else CHECKPOINTS
    folders = [hf_model_dir(f, False, stored) for f, stored in checkpoints]
    results = [_job(CPGroup(), folders)] if cp == 1 else launch(_job, cp, folders)
    for (family, stored), folder, *per_rank in zip(checkpoints, folders, *results, strict=True):
        ref_model = hf_model(folder, "bfloat16")
        toks, prefix = _tokens(ref_model.config.vocab_size)
        refs = []
        with torch.inference_mode():
            for j, t in enumerate(toks):
                full = np.concatenate([prefix, t]) if j == 2 else t
                logits = ref_model(input_ids=torch.from_numpy(full).view(1, -1)).logits[0].float()
                refs.append(logits[PREFIX:] if j == 2 else logits)
        where = f"{family} stored in {stored}, CP {cp}"
        for res in per_rank:  # every rank returns the same logits
            (gpath, glast, glogits), (epath, _, elogits) = res["graph"], res["eager"]
            assert gpath == "graph" and epath == "eager", where
            for j, (g, e, ref) in enumerate(zip(glogits, elogits, refs)):
                assert rel_err(g, ref) < TOL_HF, f"{where}, request {j}: graph vs transformers {rel_err(g, ref):.3g}"
                assert rel_err(g, e) < TOL_EAGER, f"{where}, request {j}: graph vs eager {rel_err(g, e):.3g}"
            assert rel_err(glast, torch.stack([r[-1] for r in refs])) < TOL_HF, where
