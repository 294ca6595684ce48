"""PD between any two shapes for the linear-attention hybrids (issue 49, docs/pd.md
"Import"): Qwen3.5 (dense) and Qwen3-Next (MoE) prefilled at one shape, exported to files
(graphcp-hybrid/1: a full layer's K/V, a linear layer's conv and recurrent states) and
imported at another with ``engine.import_kv``: greedy ids over 16 tokens equal to
transformers', every step's logits within 1e-4 (float32), a second turn after a fresh
import equal to transformers over the whole sequence, the pool after release equal
before. Every pair of test_pd_import.py runs as is: a hybrid decodes on every cache mode
and under attention TP. bfloat16: the first pair within 2e-2 of transformers in bfloat16.
"""

from __future__ import annotations

import pytest
from test_pd_import import FAST, PAIRS, check_bf16, check_pair, hf_reference, run_pair

MODELS = {"qwen3_5": ("qwen3_5_text", {}), "qwen3_next": ("qwen3_next", {})}


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return {dtype: {m: hf_model_dir(f, False, dtype, **kw) for m, (f, kw) in MODELS.items()}
            for dtype in ("float32", "bfloat16")}


@pytest.fixture(scope="module")
def reference(folders, hf_model):
    return {m: hf_reference(hf_model(folder, "float32")) for m, folder in folders["float32"].items()}


@pytest.mark.slow
@pytest.mark.parametrize("pair", list(PAIRS))
def test_hybrid_prefill_at_one_shape_decodes_at_another(folders, reference, pair, tmp_path):
    src, dst = PAIRS[pair]
    check_pair(run_pair(folders["float32"], src, dst, tmp_path), reference)


@pytest.mark.parametrize("pair", ["cp2-sharded->cp1"])
def test_hybrid_import_across_cp_sizes(folders, reference, pair, tmp_path):
    src, dst = FAST[pair]
    check_pair(run_pair(folders["float32"], src, dst, tmp_path), reference)


@pytest.mark.slow
def test_hybrid_bfloat16_import_decodes_within_the_suites_bound(folders, hf_model, tmp_path):
    one = {"qwen3_5": folders["bfloat16"]["qwen3_5"]}
    src, dst = PAIRS["cp4-sharded->cp2-sharded"]
    got = run_pair(one, src, dst, tmp_path, "bfloat16", mooncake=False)[0]["qwen3_5"]
    check_bf16(got, hf_model(one["qwen3_5"], "bfloat16"))
