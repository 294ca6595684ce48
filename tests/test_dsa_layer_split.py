"""LayerSplit of a DSA model's cache (``kv_cache='layer-split'``): each rank keeps MLA's
latent of its ceil(L / C) layers and the indexer keys of those that run the indexer,
plus one scratch layer in each pool. The reference is the replicated cache on the same
ranks: logits bitwise equal at CP 2 and 4, float32 and bfloat16, for a batch that
extends a cached prefix past index_topk (so the prefix fetch runs and the indexer
scores it), on DeepSeek V3.2 and on GLM-5 with "shared" indexer layers, graph off and
breakable (the replay bitwise the same-bucket eager body's and the replicated cache's
replay); each pool's bytes are (held layers) / (model layers) of the replicated one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import save_cases

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch
from graphcp.errors import ConfigError
from graphcp.kv.layers import HeldLayers
from graphcp.kv.spans import owned_layers
from graphcp.kv.spec import PoolSpec
from graphcp.model.dsa.cache import MlaGeometry, MlaStorage
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import prefill_after_prefixes

#: 4 layers, all dense (the MoE is not what this tests); index_topk 16
CASES = {
    "deepseek_v32": ("deepseek_v32", dict(num_hidden_layers=4, first_k_dense_replace=4)),
    "glm_moe_dsa-shared": ("glm_moe_dsa", dict(num_hidden_layers=4, first_k_dense_replace=4,
                                               indexer_types=["full", "shared", "full", "shared"])),
}
#: (prefix, new) lengths: a request extending a cached prefix past index_topk, a fresh long one, a short one
BATCH = [(45, 70), (0, 33), (17, 3)]
BUCKETS = BucketSet((64, 128))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_cases(tmp_path_factory, CASES, seed=3)


def _batch(seed: int = 0, vocab: int = 512):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, p) if p else None, rng.integers(0, vocab, n)) for p, n in BATCH]


def _pools(kv) -> tuple[int, int]:
    return (kv.pool.numel() * kv.pool.element_size(), kv.index_pool.numel() * kv.index_pool.element_size())


def _both_caches(group, runs):
    """Per (folder, dtype): each cache mode's logits, pool bytes (stats and per pool) and bytes received."""
    out = []
    for folder, dtype in runs:
        res = {}
        for mode in ("replicated", "layer-split"):
            eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=1024, kv_cache=mode), group)
            o = prefill_after_prefixes(eng, _batch(), all_logits=True)
            res[mode] = (o.last_logits, o.logits, eng.stats()["kv_pool_bytes"], _pools(eng.parts.kv.storage),
                         o.info.stats["bytes_received"])
        out.append(res)
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_layer_split_equals_replicated_bitwise_with_a_share_of_the_pools(folders, cp):
    runs = [(folders[case], dtype) for case in CASES for dtype in ("float32", "bfloat16")]
    for rank, results in enumerate(launch(_both_caches, cp, runs)):
        for (folder, dtype), res in zip(runs, results):
            what = (folder.name, dtype, cp, rank)
            (rl, rall, rstat, (rlat, ridx), rgot), (sl, sall, sstat, (slat, sidx), sgot) = (
                res["replicated"], res["layer-split"])
            assert torch.equal(sl, rl), what
            assert all(torch.equal(a, b) for a, b in zip(sall, rall)), what
            # each pool: the owned layers + its scratch layer, of the model's
            indexer = CASES["glm_moe_dsa-shared" if "glm" in folder.name else "deepseek_v32"][1].get(
                "indexer_types", ["full"] * 4)
            owned = owned_layers(rank, 4, cp)
            owned_index = sum(indexer[i] == "full" for i in owned)
            assert slat * 4 == rlat * (len(owned) + 1), what
            assert sidx * indexer.count("full") == ridx * (owned_index + 1), what
            assert (sstat, rstat) == (slat + sidx, rlat + ridx), what  # engine.stats() counts both pools
            assert sstat < rstat, what
            assert sgot > rgot, what  # the extend received the prefix pages of the layers other ranks own


def _graph_vs_eager(group, folder):
    """The layer-split engine's breakable replay vs its same-bucket eager body, and vs the
    replicated cache's replay (logits)."""
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, kv_cache="layer-split", graph="breakable"), group,
                        BUCKETS)
    eng.capture()  # each bucket self-checked (hidden rows and both pools) on a synthetic batch
    handles = [None if p is None else eng.prefill([Request(p)]).handles[0] for p, _ in _batch()]
    prep = eng.parts.preparer.prepare([Request(n, h) for (_, n), h in zip(_batch(), handles)])
    sel = eng.parts.runner.select(prep.plan.max_local_rows)
    same_bucket = eng.parts.runner.eager_on_bucket(prep, sel.capacity).clone()
    hidden, info = eng.parts.runner.try_replay(prep)
    eng.parts.preparer.abort(prep)
    graph = prefill_after_prefixes(eng, _batch())
    ref = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, graph="breakable"), group, BUCKETS)
    rg = prefill_after_prefixes(ref, _batch())
    return info.path, graph.info.path, bool(torch.equal(hidden, same_bucket)), bool(
        torch.equal(graph.last_logits, rg.last_logits))


def test_breakable_graphs_replay_the_layer_split_bitwise(folders):
    for path, graph_path, bitwise, same_as_replicated in launch(_graph_vs_eager, 2, folders["glm_moe_dsa-shared"]):
        assert path == graph_path == "graph"
        assert bitwise  # the replay (the fetch in the attention break) equals the same-bucket eager body
        assert same_as_replicated


def test_pools_hold_the_owned_layers_and_one_scratch_layer_each():
    indexer = (True, False, True, True)  # layer 1 reuses layer 0's selection
    held = HeldLayers(range(4), owned_layers(0, 4, 2), 2, split=True)  # rank 0 of a layer split over 2
    kv = MlaStorage(MlaGeometry(32, 8, 16, indexer), PoolSpec(range(4), 8, 16, torch.float32), held)
    assert kv.pool.shape[0] == 3 and kv.index_pool.shape[0] == 2  # layers 0, 1 (+ scratch); indexer: 0 (+ scratch)
    assert kv.latent(1).data_ptr() == kv.pool[1].data_ptr()
    assert kv.latent(2).data_ptr() == kv.latent(3).data_ptr() == kv.pool[2].data_ptr()
    assert kv.index_keys(2).data_ptr() == kv.index_keys(3).data_ptr() == kv.index_pool[1].data_ptr()
    with pytest.raises(ValueError, match="layer 1 reuses an earlier layer's top-k"):
        kv.index_keys(1)
    with pytest.raises(IndexError, match="layer 4 is not split here: this cache splits layers 0..3"):
        kv.latent(4)
    assert [c.shape[-1] for c in kv.layer_pools(2)] == [40, 16] and len(kv.layer_pools(1)) == 1


def test_refusals_name_the_value(folders):
    folder = folders["deepseek_v32"]
    with pytest.raises(ConfigError, match=r"^a deepseek_v32 model \(DSA\) with RuntimeConfig.kv_cache='sharded': "
                                          r".*; use RuntimeConfig.kv_cache='layer-split' or "):
        PrefillEngine(folder, RuntimeConfig(kv_tokens=256, kv_cache="sharded"))
