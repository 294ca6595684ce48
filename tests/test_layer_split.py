"""LayerSplit (``kv_cache='layer-split'``): each rank keeps ceil(L / C) layers' cache and
one scratch layer. The reference is the replicated engine on the same ranks: logits
bitwise equal in float32 and bfloat16, with and without a cached prefix (whose pages
come from each layer's owner), on the eager path and on breakable graphs (a replay
equal to the same-bucket eager body bitwise); the pool is (1 + 1) / 4 of the
replicated one at C = 4 on a 4-layer model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import kv_cache

from graphcp import ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch
from graphcp.errors import ConfigError
from graphcp.kv.spans import KVSpan, layer_owner, owned_layers
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import prefill_after_prefixes

#: (prefix, new) lengths: a long request extending a cached prefix, a fresh one, a short one
BATCH = [(45, 70), (0, 33), (17, 3)]


def _batch(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, p) if p else None, rng.integers(0, vocab, n)) for p, n in BATCH]


def _both_caches(group, folder, dtypes):
    """Per dtype: the replicated and the layer-split engine's logits and pool bytes."""
    out = []
    for dtype in dtypes:
        res = {}
        for mode in ("replicated", "layer-split"):
            eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=512, kv_cache=mode), group)
            o = prefill_after_prefixes(eng, _batch(eng.cfg.vocab_size), all_logits=True)
            # the pool as the stats file reports it (graphcp prefill --stats writes engine.stats())
            res[mode] = (o.last_logits, o.logits, eng.stats()["kv_pool_bytes"], o.info.stats["bytes_received"])
        out.append(res)
    return out


def test_layer_split_equals_replicated_with_a_quarter_plus_one_of_the_pool(hf_model_dir):
    folder = hf_model_dir("qwen3", False, "float32", num_hidden_layers=4)
    per_rank = launch(_both_caches, 4, folder, ("float32", "bfloat16"))
    for rank, results in enumerate(per_rank):
        for dtype, res in zip(("float32", "bfloat16"), results):
            (rl, rall, rbytes, rgot), (sl, sall, sbytes, sgot) = res["replicated"], res["layer-split"]
            assert torch.equal(sl, rl), (rank, dtype)
            assert all(torch.equal(a, b) for a, b in zip(sall, rall)), (rank, dtype)
            # 1 owned layer + the scratch layer of 4: the same pages, half the bytes
            assert sbytes * 4 == rbytes * 2, (rank, dtype, sbytes, rbytes)
            # the extend also received the prefix pages of the 3 layers other ranks own
            assert sgot > rgot, (rank, dtype, sgot, rgot)


def _graph_vs_eager(group, folder):
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=512, kv_cache="layer-split", graph="breakable"), group,
                        BucketSet((64, 128)))
    eng.capture()  # each bucket self-checked on a synthetic batch that extends a prefix
    ref = PrefillEngine(folder, RuntimeConfig(kv_tokens=512), group)
    vocab = eng.cfg.vocab_size
    handles = [None if p is None else eng.prefill([Request(p)]).handles[0] for p, _ in _batch(vocab)]
    prep = eng.parts.preparer.prepare([Request(n, h) for (_, n), h in zip(_batch(vocab), handles)])
    sel = eng.parts.runner.select(prep.plan.max_local_rows)
    same_bucket = eng.parts.runner.eager_on_bucket(prep, sel.capacity).clone()
    hidden, info = eng.parts.runner.try_replay(prep)
    eng.parts.preparer.abort(prep)
    graph = prefill_after_prefixes(eng, _batch(vocab))
    eager = prefill_after_prefixes(ref, _batch(vocab))
    replicated_graph = PrefillEngine(folder, RuntimeConfig(kv_tokens=512, graph="breakable"), group,
                                     BucketSet((64, 128)))
    rg = prefill_after_prefixes(replicated_graph, _batch(vocab))
    return (info.path, bool(torch.equal(hidden, same_bucket)), graph.info.path,
            bool(torch.equal(graph.last_logits, rg.last_logits)), float((graph.last_logits - eager.last_logits).abs().max()))


def test_breakable_graphs_replay_layer_split_with_a_cached_prefix(hf_model_dir):
    folder = hf_model_dir("qwen3", False, "float32", num_hidden_layers=4)
    for path, bitwise, graph_path, same_as_replicated, vs_eager in launch(_graph_vs_eager, 2, folder):
        assert path == "graph" and graph_path == "graph"
        assert bitwise  # the replay (the broadcast in the attention break) equals the same-bucket eager body
        assert same_as_replicated  # and the replicated cache's replay
        assert vs_eager < 1e-4  # the unpadded eager forward: rounding over padded rows only


@pytest.mark.parametrize("num_layers,cp", [(4, 4), (4, 3), (2, 4), (7, 2), (1, 1)])
def test_owned_layers_cover_every_layer_once(num_layers, cp):
    ranges = [owned_layers(r, num_layers, cp) for r in range(cp)]
    assert [i for r in ranges for i in r] == list(range(num_layers))
    assert all(len(r) <= -(-num_layers // cp) for r in ranges)
    assert all(layer_owner(i, num_layers, cp) == r for r, rg in enumerate(ranges) for i in rg)


def test_refusals():
    with pytest.raises(ConfigError, match="kv_cache must be one of replicated, sharded, layer-split"):
        RuntimeConfig(kv_cache="paged")
    kv = kv_cache("layer-split", 4, 8, 16, 2, 32, rank=0, cp_size=2)
    assert kv.pool.shape[0] == 3 and kv.layer(1).data_ptr() == kv.pool[1].data_ptr()
    assert kv.layer(2).data_ptr() == kv.layer(3).data_ptr() == kv.pool[2].data_ptr()  # the one scratch layer
    h = kv.handle(kv.extend([None], [3])[0])
    with pytest.raises(ValueError, match="rank 0 does not hold layer 3 .* read it on rank 1"):
        kv.read_span(h, KVSpan(3, 0, 3, 1))


def _pipeline_caches(group, folder, cases):
    """PP 2 x CP 2 on an 8-layer model: each stage splits its own 4 layers over its 2 CP
    ranks. Per case the replicated and the layer-split engines' logits, pool bytes and
    export (every rank receives), with graphs as asked and micro-batches."""
    out = []
    for dtype, microbatches, graph in cases:
        res = {}
        for mode in ("replicated", "layer-split"):
            rt = RuntimeConfig(dtype=dtype, kv_tokens=512, kv_cache=mode, graph=graph, microbatches=microbatches,
                               verify_capture=False)
            eng = PrefillEngine(folder, rt, group, BucketSet((16, 32, 64, 128), padding_factor=64.0),
                                ParallelConfig(cp_size=2, pp_size=2))
            o = prefill_after_prefixes(eng, _batch(eng.cfg.vocab_size), all_logits=True)
            exports = eng.export_kv_batch(o.handles)
            res[mode] = (o.last_logits, o.logits, eng.stats()["kv_pool_bytes"], [e.k + e.v for e in exports],
                         o.info.path, list(eng.parts.kv.placement.owned) if mode == "layer-split" else None)
        out.append(res)
    return out


def test_pipeline_stages_split_their_own_layers(hf_model_dir):
    folder = hf_model_dir("qwen3", False, "float32", num_hidden_layers=8)
    cases = [("float32", 1, "off"), ("bfloat16", 4, "off"), ("float32", 2, "breakable")]
    per_rank = launch(_pipeline_caches, 4, folder, cases)
    for rank, results in enumerate(per_rank):
        stage, cp_rank = divmod(rank, 2)
        for case, res in zip(cases, results):
            (rl, rall, rbytes, rkv, rpath, _), (sl, sall, sbytes, skv, spath, owned) = (
                res["replicated"], res["layer-split"])
            where = (rank, case)
            assert owned == [4 * stage + 2 * cp_rank, 4 * stage + 2 * cp_rank + 1], where  # global layers
            assert spath == rpath == ("graph" if case[2] == "breakable" else "eager"), where
            assert torch.equal(sl, rl) and all(torch.equal(a, b) for a, b in zip(sall, rall)), where
            # the stage's 4 layers: 2 owned + the scratch layer, the same pages
            assert sbytes * 4 == rbytes * 3, (where, sbytes, rbytes)
            # the export gathers every stage's layers from their owners: the replicated bits
            assert all(torch.equal(a, b) for x, y in zip(skv, rkv) for a, b in zip(x, y)), where
