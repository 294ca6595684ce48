"""The token-sharded cache under pipeline stages: each stage's CP group shards its own
layers' KV token-wise and its rings (pass-KV, pass-Q, auto) run over the stage's CP
subgroup (point-to-point peers mapped to the global ranks torch expects). PP 2 x CP 2:
logits within the ring's merge rounding of the replicated pipeline on the same ranks
(float32 and bfloat16), cached prefixes extended, 1 and 4 micro-batches, breakable
graphs; a rank stores about 1/C of every request, for its stage's layers only; the
export equals the replicated one."""

from __future__ import annotations

import numpy as np
from cp_utils import rel_err

from graphcp import ParallelConfig, PrefillEngine, RuntimeConfig
from graphcp.dist import launch
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import prefill_after_prefixes

TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # the ring's LSE merge against the all-gather
#: (prefix, new): a long request extending a cached prefix, a fresh one, a short extend
BATCH = [(40, 57), (0, 31), (9, 2)]
BUCKETS = BucketSet((16, 32, 64, 128), padding_factor=64.0)


def _batch(vocab: int):
    rng = np.random.default_rng(4)
    return [(rng.integers(0, vocab, p) if p else None, rng.integers(0, vocab, n)) for p, n in BATCH]


def _job(group, folder, cases):
    out = []
    for dtype, exchange, microbatches, graph in cases:
        res = {}
        for mode in ("replicated", "sharded"):
            rt = RuntimeConfig(dtype=dtype, kv_tokens=512, kv_cache=mode, graph=graph, microbatches=microbatches,
                               exchange=exchange if mode == "sharded" else "auto", verify_capture=False)
            eng = PrefillEngine(folder, rt, group, BUCKETS, ParallelConfig(cp_size=2, pp_size=2))
            o = prefill_after_prefixes(eng, _batch(eng.cfg.vocab_size), all_logits=True)
            exports = eng.export_kv_batch(o.handles)
            st = eng.stats()
            assert (st["world_rank"], st["stage"], st["layers"]) == (group.rank, group.rank // 2,
                                                                      [2 * (group.rank // 2), 2 * (group.rank // 2) + 2])
            used = {f["exchange"] for f in st["forwards"]}  # every forward's, micro-batches each their own
            res[mode] = (o.logits, o.info.path, used, st["kv_stored_tokens"],
                         st["kv_pool_bytes"] // st["kv_pool_tokens"], [e.k + e.v for e in exports],
                         [h.num_tokens for h in o.handles])
        out.append(res)
    return out


def test_pipeline_stages_shard_their_own_layers(hf_model_dir):
    folder = hf_model_dir("qwen3", False, "float32", num_hidden_layers=4)
    cases = [("float32", "pass-kv", 1, "off"), ("float32", "pass-q", 4, "off"), ("bfloat16", "auto", 1, "off"),
             ("float32", "pass-kv", 4, "breakable")]
    per_rank = launch(_job, 4, folder, cases)
    for rank, results in enumerate(per_rank):
        for case, res in zip(cases, results):
            dtype, exchange, m, graph = case
            where = (rank, case)
            rep_logits, rep_path, _, rep_stored, rep_bytes_per_token, rep_kv, tokens = res["replicated"]
            logits, path, used, stored, bytes_per_token, kv, _ = res["sharded"]
            assert path == rep_path == ("graph" if graph == "breakable" else "eager"), where
            assert used == ({exchange} if exchange != "auto" else used & {"pass-kv", "pass-q"}) != set(), (where, used)
            assert res["replicated"][2] == {"all-gather"}, where
            for got, want in zip(logits, rep_logits):
                assert rel_err(got, want) <= TOL[dtype], where
            # this rank's stage: 2 of the 4 layers, both caches; the sharded one holds about
            # 1/C of every request's tokens (its zigzag blocks of each chunk), the other all
            assert bytes_per_token == rep_bytes_per_token, where
            assert rep_stored == sum(tokens), where
            stage_peer = per_rank[rank ^ 1][cases.index(case)]["sharded"][3]  # the other CP rank of the stage
            assert stored + stage_peer == sum(tokens) and abs(stored - stage_peer) <= 2 * 2 * len(tokens), where
            for x, y in zip(kv, rep_kv):
                for a, b in zip(x, y):
                    assert rel_err(a, b) <= TOL[dtype], where
