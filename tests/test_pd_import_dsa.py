"""PD between any two shapes for DSA models (issue 49, docs/pd.md "Import"): a GLM-5-style
model with 'shared' indexer layers (layers 1 and 3 reuse the top-k of layers 0 and 2),
prefilled at one shape, exported to files (graphcp-mla/1: latents, rope keys, indexer
keys) and imported at another: greedy ids over 16 tokens equal to transformers' (the
prompts run past index_topk, so every step selects), every step's logits within 1e-4
(float32), a second turn after a fresh import equal to transformers over the whole
sequence, the pool after release equal before.

A DSA model runs neither the token-sharded cache, attention TP nor attention DP
(combinations.py), so each pair of test_pd_import.py runs at the nearest shape it has
(NEAREST; docs/pd.md): sharded -> layer-split (the mode whose pool scales with the ranks),
CP 2 x attention TP 2 -> CP 4 replicated (as many ranks, every rank all heads), attention
DP 2 x CP 2 -> CP 2 replicated (each DP replica is a replicated CP 2 group). bfloat16:
within 2e-2 of transformers in bfloat16 on the same sequence.
"""

from __future__ import annotations

import pytest
from conftest import save_cases
from test_pd_import import check_bf16, check_pair, hf_reference, run_pair, shape

MODELS = {"glm": ("glm_moe_dsa", dict(num_hidden_layers=4, first_k_dense_replace=4,
                                      indexer_types=["full", "shared", "full", "shared"]))}
#: test_pd_import.PAIRS' pairs at the nearest shapes a DSA model runs
NEAREST = {
    "cp4-sharded->cp2-sharded": (shape(4, "layer-split"), shape(2, "layer-split")),
    "cp2-layer-split->cp4-sharded": (shape(2, "layer-split"), shape(4, "layer-split")),
    "cp2xtp2->cp1": (shape(4, "replicated"), shape(1)),
    "pp2xcp2->cp2-replicated": (shape(2, "replicated", pp=2), shape(2, "replicated")),
    "cp1->cp4-sharded": (shape(1), shape(4, "layer-split")),
    "dp2xcp2->cp2-sharded": (shape(2, "replicated"), shape(2, "layer-split")),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A float32 checkpoint, run in float32 and in bfloat16 (graphcp and transformers cast it)."""
    saved = save_cases(tmp_path_factory, MODELS, seed=0)
    return {"float32": saved, "bfloat16": saved}


@pytest.fixture(scope="module")
def reference(folders, hf_model):
    return {m: hf_reference(hf_model(folder, "float32")) for m, folder in folders["float32"].items()}


@pytest.mark.slow
@pytest.mark.parametrize("pair", [p for p in NEAREST if p != "dp2xcp2->cp2-sharded"])
def test_dsa_prefill_at_one_shape_decodes_at_another(folders, reference, pair, tmp_path):
    src, dst = NEAREST[pair]
    check_pair(run_pair(folders["float32"], src, dst, tmp_path), reference)


def test_dsa_import_from_replicated_into_layer_split(folders, reference, tmp_path):
    src, dst = NEAREST["dp2xcp2->cp2-sharded"]
    check_pair(run_pair(folders["float32"], src, dst, tmp_path), reference)


@pytest.mark.slow
def test_dsa_bfloat16_import_decodes_within_the_suites_bound(folders, hf_model, tmp_path):
    src, dst = NEAREST["cp4-sharded->cp2-sharded"]
    got = run_pair(folders["bfloat16"], src, dst, tmp_path, "bfloat16", mooncake=False)[0]["glm"]
    check_bf16(got, hf_model(folders["bfloat16"]["glm"], "bfloat16"))
