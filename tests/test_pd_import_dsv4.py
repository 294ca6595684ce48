"""PD between any two shapes for DeepSeek V4 (issue 49, docs/pd.md "Import"): a request
prefilled at one shape, exported (graphcp-dsv4/1: transformers' state, the last window
rows, the pooled entries, the compressors' remainders and CSA's overlap) and imported at
another with ``engine.import_kv``, which writes that state back into V4's pools (the
window rows, the entries, and the source rows the next poolings read:
``DsV4Source.write_import``): greedy ids over 16 tokens equal to transformers' (the
decode steps close CSA and HCA windows: m = 4 and 8, and select among the entries,
index_topk 3), every step's logits within 1e-4 (float32), a second turn after a fresh
import equal to transformers over the whole sequence, the pool after release equal
before. A V4 model runs no token-sharded cache (combinations.py): each sharded side runs
layer-split (NEAREST); attention TP, stages and attention DP as the pairs say. bfloat16:
the first pair within 2e-2 of transformers in bfloat16 on the same sequence. An import's
re-export is the payload (the overlap gates within one float32 rounding: the export adds
the position bias, the import subtracts it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_pd_import import LENS, NEW, TOL, _engine, _prompts, check_bf16, check_pair, hf_reference, run_pair, shape

from graphcp import Request
from graphcp.dist import CPGroup

MODELS = {"v4": ("deepseek_v4", {})}
#: test_pd_import.PAIRS' pairs, the sharded sides layer-split
NEAREST = {
    "cp4-sharded->cp2-sharded": (shape(4, "layer-split"), shape(2, "layer-split")),
    "cp2-layer-split->cp4-sharded": (shape(2, "layer-split"), shape(4, "layer-split")),
    "cp2xtp2->cp1": (shape(2, "replicated", attn_tp=2), shape(1)),
    "pp2xcp2->cp2-replicated": (shape(2, "replicated", pp=2), shape(2, "replicated")),
    "cp1->cp4-sharded": (shape(1), shape(4, "layer-split")),
    "dp2xcp2->cp2-sharded": (shape(2, "replicated", dp=2), shape(2, "layer-split")),
}
FAST = "dp2xcp2->cp2-sharded"


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return {dtype: {m: hf_model_dir(f, False, dtype, **kw) for m, (f, kw) in MODELS.items()}
            for dtype in ("float32", "bfloat16")}


@pytest.fixture(scope="module")
def reference(folders, hf_model):
    return {m: hf_reference(hf_model(folder, "float32")) for m, folder in folders["float32"].items()}


@pytest.mark.slow
@pytest.mark.parametrize("pair", [p for p in NEAREST if p != FAST])
def test_v4_prefill_at_one_shape_decodes_at_another(folders, reference, pair, tmp_path):
    src, dst = NEAREST[pair]
    check_pair(run_pair(folders["float32"], src, dst, tmp_path), reference)


def test_v4_import_from_attention_dp_into_layer_split(folders, reference, tmp_path):
    src, dst = NEAREST[FAST]
    check_pair(run_pair(folders["float32"], src, dst, tmp_path), reference)


@pytest.mark.slow
def test_v4_bfloat16_import_decodes_within_the_suites_bound(folders, hf_model, tmp_path):
    src, dst = NEAREST["cp4-sharded->cp2-sharded"]
    got = run_pair(folders["bfloat16"], src, dst, tmp_path, "bfloat16", mooncake=False)[0]["v4"]
    check_bf16(got, hf_model(folders["bfloat16"]["v4"], "bfloat16"))


@pytest.mark.parametrize("length", [3, 6, 13, 45])
def test_v4_import_reexports_the_payload(folders, length):
    """Below a CSA window (no overlap state), below the sliding window, and past both: the
    import's re-export is the payload (bit for bit but the overlap gates, within one
    float32 rounding), and a next turn after it equals the source engine's own."""
    folder = folders["float32"]["v4"]
    a, b = _engine(folder, CPGroup(), shape(1)), _engine(folder, CPGroup(), shape(1))
    prompt = np.random.default_rng(length).integers(0, a.cfg.vocab_size, length)
    res = a.prefill([Request(prompt)])
    payload = a.export_kv(res.handles[0])
    h = b.import_kv(payload)
    again = b.export_kv(h)
    for i, name in payload.meta.tensors():
        want, got = payload.tensor(i, name), again.tensor(i, name)
        if name.endswith("overlap_gate"):
            torch.testing.assert_close(got, want, rtol=2 ** -23, atol=2 ** -23 * want.abs().max())
        else:
            assert torch.equal(got, want), (i, name)
    turn = np.random.default_rng(9).integers(0, a.cfg.vocab_size, 11)  # closes windows of both kinds
    ref = a.prefill([Request(turn, prefix=res.handles[0])], all_logits=True).logits[0]
    got = b.prefill([Request(turn, prefix=h)], all_logits=True).logits[0]
    assert (got - ref).abs().max() <= TOL["float32"] * ref.abs().max()


def test_v4_bfloat16_import_continues_bitwise_like_the_engines_own(folders, tmp_path):
    """In bfloat16 an import continues exactly as the engine's own prefill of the same chunks
    (every step's logits bit for bit, fed the same tokens): the overlap gates' bias round
    trip included. (Across shapes a bfloat16 V4 prefill itself differs: the first pair's
    check is against transformers within 2e-2.)"""
    folder = folders["bfloat16"]["v4"]
    got = run_pair({"v4": folder}, shape(1), shape(1), tmp_path, "bfloat16", mooncake=False)[0]["v4"]
    eng = _engine(folder, CPGroup(), shape(1), "bfloat16")
    prompts = _prompts(eng.cfg.vocab_size)
    first = eng.prefill([Request(prompts[0][:LENS[0][0]])]).handles[0]
    res = eng.prefill([Request(prompts[0][LENS[0][0]:], prefix=first), Request(prompts[1])])
    handles, own = res.handles, [res.last_logits]
    for i in range(1, NEW):
        step = eng.decode(handles, got["tokens"][:, i - 1], logits=True)
        handles = step.handles
        own.append(step.logits)
    assert torch.equal(got["logits"], torch.stack(own, 1))
