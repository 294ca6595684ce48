"""DSA models (DeepSeek V3.2, GLM-5) under pipeline stages: each stage holds its MLA and
indexer caches for its own layers, hidden rows stay CP-local between stages and the last
stage gathers. PP 2 x CP 1 and PP 2 x CP 2 against transformers (float32, requests past
index_topk and a cached prefix extended past it; the parity test's batch), MoE `ep` and
`tp`, 1 and 3 micro-batches, breakable graphs, LayerSplit of the DSA caches per stage;
bfloat16 within index_topk against the single-rank engine; the graphcp-mla/1 export
against the same CP size without stages, float32 and bfloat16. A split that starts a
stage at a GLM 'shared' layer (it reuses the top-k of a layer on the stage before) is
refused."""

from __future__ import annotations

import pytest
import torch
from conftest import save_cases
from helpers import rel_err
from test_dsa_parity import BUCKETS, MOE, TOL, _prefill, _reference

from graphcp import ConfigError, ParallelConfig, PrefillEngine, RuntimeConfig
from graphcp.dist import CPGroup, launch

#: the export under PP against the same CP size without stages
EXPORT_TOL = {"float32": 1e-5, "bfloat16": 1e-2}
CASES = {
    # 2 layers: layer 0 dense, layer 1 MoE; a stage each
    "deepseek_v32-moe": ("deepseek_v32", dict(MOE, n_group=2, topk_group=1)),
    # 4 layers, 'shared' ones reusing the previous 'full' layer's top-k; stages [0, 1], [2, 3]
    "glm_moe_dsa-shared": ("glm_moe_dsa", dict(MOE, num_hidden_layers=4,
                                               indexer_types=["full", "shared", "full", "shared"])),
    # a 'shared' layer right at the stage boundary
    "glm_moe_dsa-boundary": ("glm_moe_dsa", dict(indexer_types=["full", "shared"])),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_cases(tmp_path_factory, CASES, seed=5)


def _job(group, runs, cp):
    out = []
    for folder, dtype, moe, kv_cache, graph, microbatches in runs:
        rt = RuntimeConfig(dtype=dtype, kv_tokens=2048, moe=moe, kv_cache=kv_cache, graph=graph,
                           microbatches=microbatches, verify_capture=False)
        eng = PrefillEngine(folder, rt, group, BUCKETS, ParallelConfig(cp_size=cp, pp_size=2))
        logits, stats, path = _prefill(eng, dtype)
        out.append((logits, path, eng.stats()["layers"]))
    return out


def _refused(group, folder):
    try:
        PrefillEngine(folder, RuntimeConfig(kv_tokens=256), group, parallel=ParallelConfig(pp_size=2))
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("cp", [1, 2])
def test_dsa_pipeline_stages_match_transformers(folders, cp):
    runs = [(folders["deepseek_v32-moe"], "float32", "ep", "replicated", "off", 1),
            (folders["glm_moe_dsa-shared"], "float32", "tp", "replicated", "breakable", 3)]
    if cp == 2:
        runs += [(folders["deepseek_v32-moe"], "float32", "tp", "layer-split", "breakable", 1),
                 (folders["glm_moe_dsa-shared"], "float32", "ep", "layer-split", "off", 3)]
    else:
        runs += [(folders["deepseek_v32-moe"], "bfloat16", "ep", "replicated", "off", 1)]
    per_rank = launch(_job, 2 * cp, runs, cp)
    refs = {}
    for i, (folder, dtype, moe, kv_cache, graph, m) in enumerate(runs):
        where = f"{folder.name} {dtype} PP 2 x CP {cp} moe {moe} {kv_cache} graph {graph} M={m}"
        if dtype == "float32":
            ref = refs.setdefault((folder, dtype), _reference(folder, dtype))
        else:  # bfloat16 within index_topk: against the single-rank engine (docs/dsa.md)
            one = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=2048, moe=moe))
            ref = _prefill(one, dtype)[0]
        num_layers = 4 if "shared" in folder.name else 2
        for rank, results in enumerate(per_rank):
            logits, path, layers = results[i]
            stage = rank // cp
            assert layers == [stage * num_layers // 2, (stage + 1) * num_layers // 2], (where, rank, layers)
            assert path == ("eager" if graph == "off" else "graph"), (where, rank)
            for j, (g, r) in enumerate(zip(logits, ref)):
                assert rel_err(g, r) < TOL[dtype], f"{where}, rank {rank}, request {j}: {rel_err(g, r):.3g}"
            assert all(torch.equal(a, b) for a, b in zip(logits, per_rank[0][i][0])), (where, rank)


def test_a_stage_that_starts_at_a_shared_layer_is_refused(folders):
    for msg in launch(_refused, 2, folders["glm_moe_dsa-boundary"]):
        assert msg is not None and "stage 1 starts at layer 1, a 'shared' layer" in msg, msg
        assert "start every stage at a 'full' layer (one of [0])" in msg, msg


def _export_job(group, folder, kv_cache, dtype, pp):
    from test_dsa_parity import _tokens

    from graphcp import Request

    rt = RuntimeConfig(kv_tokens=2048, kv_cache=kv_cache, dtype=dtype)
    eng = PrefillEngine(folder, rt, group, parallel=ParallelConfig(cp_size=group.size // pp, pp_size=pp))
    toks, prefix, ext = _tokens(dtype)
    h = eng.prefill([Request(prefix)]).handles[0]
    h = eng.prefill([Request(ext, h)]).handles[0]
    return eng.export_kv(h)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dsa_export_gathers_every_stage(folders, dtype):
    """graphcp-mla/1 under PP 2 (every stage's latent, rope and indexer keys; a GLM
    'shared' layer has no indexer key) equals the export of the same CP size without
    stages (bfloat16 too: the same CP split rounds the same way; across CP sizes bf16
    flips near-tied expert choices, docs/dsa.md)."""
    folder = folders["glm_moe_dsa-shared"]
    for cp, kv_cache in ((1, "replicated"), (2, "layer-split")):
        want = launch(_export_job, cp, folder, kv_cache, dtype, 1)[0] if cp > 1 else _export_job(
            CPGroup(), folder, kv_cache, dtype, 1)
        for export in launch(_export_job, 2 * cp, folder, kv_cache, dtype, 2):
            assert export.meta == want.meta, (cp, kv_cache)
            for layer in range(4):
                got, ref = export.layers[layer], want.layers[layer]
                assert sorted(got) == sorted(ref) == (["index_key", "latent", "rope_key"] if layer % 2 == 0
                                                      else ["latent", "rope_key"]), layer
                for name in ref:
                    assert rel_err(got[name], ref[name]) < EXPORT_TOL[dtype], (dtype, cp, kv_cache, layer, name)
