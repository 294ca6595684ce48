"""Attention TP inside CP (ParallelConfig.tp_size > cp_size): each rank holds a slice of
the heads, its KV cache holds only them, the KV exchange runs over the CP group within
one head shard, o_proj's partial sums are all-reduced over attention TP, and the layer
communicator runs the MLP / MoE over all T ranks.

One launch of 4 gloo ranks runs every case (engines of different meshes over the same
ranks): (T, C) = (4, 2), (4, 1) (KV heads replicated: 2 KV heads over 4 ranks) and (4, 4)
(attention TP 1), a dense family (Qwen3) and Qwen3-MoE (a dense layer between, ep and
tp), zigzag and interleave, replicated / sharded / layer-split caches, graphs off,
breakable and full, float32 and bfloat16, two pipeline stages each holding the mesh, with cached prefixes: last-token and all-token logits
and auxiliary hidden states against a single-rank run (1e-5 / 2e-2) and transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import mesh_engine, rel_err, twin_of

from graphcp import (
    ConfigError,
    InputError,
    ModelConfig,
    ParallelConfig,
    PrefillEngine,
    RuntimeConfig,
)
from graphcp.attention.exchange import exchanged_bytes_per_layer
from graphcp.dist import launch
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import prefill_after_prefixes

LENS = [37, 1, 6, 20]
PREFIX = [0, 0, 13, 4]
AUX = (1, 0)
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
HF_TOL = 1e-4
BUCKETS = BucketSet((16, 32, 64), padding_factor=64.0)
#: (tp, cp, pp, family, dtype, layout, kv_cache, graph, moe)
CASES = [
    (4, 2, 1, "qwen3", "float32", "zigzag", "replicated", "off", "ep"),
    (4, 2, 1, "qwen3", "float32", "interleave", "replicated", "breakable", "ep"),
    (4, 2, 1, "qwen3", "float32", "zigzag", "sharded", "breakable", "ep"),
    (4, 2, 1, "qwen3", "bfloat16", "zigzag", "layer-split", "breakable", "ep"),
    (4, 2, 1, "qwen3", "bfloat16", "interleave", "replicated", "off", "ep"),
    (4, 1, 1, "qwen3", "float32", "zigzag", "replicated", "breakable", "ep"),
    (4, 1, 1, "qwen3", "bfloat16", "zigzag", "sharded", "off", "ep"),
    (4, 4, 1, "qwen3", "float32", "zigzag", "replicated", "breakable", "ep"),
    (4, 2, 1, "qwen3", "float32", "zigzag", "replicated", "full", "ep"),  # attention captured too (triton)
    (4, 2, 1, "qwen3_moe", "float32", "zigzag", "replicated", "breakable", "ep"),
    (4, 2, 1, "qwen3_moe", "bfloat16", "zigzag", "sharded", "off", "ep"),
    (4, 2, 1, "qwen3_moe", "float32", "zigzag", "sharded", "off", "tp"),
    (4, 2, 1, "qwen3_moe", "bfloat16", "zigzag", "replicated", "breakable", "tp"),
    (4, 1, 1, "qwen3_moe", "float32", "interleave", "layer-split", "off", "ep"),
    # Llama (q/k/v and o_proj biases, an MLP bias: sliced or added once) and Mixtral
    (4, 2, 1, "llama", "float32", "zigzag", "replicated", "breakable", "ep"),
    (4, 1, 1, "llama", "bfloat16", "interleave", "layer-split", "off", "ep"),
    (4, 2, 1, "mixtral", "float32", "zigzag", "replicated", "off", "ep"),
    # two pipeline stages, each holding attention TP 2 (world 4 = 2 stages x 2)
    (2, 1, 2, "qwen3", "float32", "zigzag", "replicated", "breakable", "ep"),
    (2, 1, 2, "qwen3_moe", "bfloat16", "zigzag", "sharded", "off", "tp"),
]


def _batch(vocab: int):
    rng = np.random.default_rng(5)
    return [(rng.integers(0, vocab, p) if p else None, rng.integers(0, vocab, n)) for n, p in zip(LENS, PREFIX)]


def _run(eng, rank: int = 0, size: int = 1):
    """The batch's outputs, and the KV export (every rank receiving) of request 2: its
    cached prefix and new tokens, every layer's K and V with all the model's KV heads.
    Exported to one rank ``dst`` of the whole run (``rank`` of ``size``, the launch's
    numbering: attention-TP ranks fastest, stage-major), exactly that rank receives it:
    the first attention-TP rank but one, and the last rank (of the last stage)."""
    out = prefill_after_prefixes(eng, _batch(eng.cfg.vocab_size), all_logits=True, aux_hidden_layers=AUX)
    export = eng.export_kv(out.handles[2])
    assert (eng.world_rank, eng.world.size) == (rank, size)
    for dst in sorted({min(1, size - 1), size - 1}):
        got = eng.export_kv(out.handles[2], dst=dst)
        assert (got is None) == (rank != dst), (rank, dst)
        assert got is None or all(torch.equal(a, b) for a, b in zip(got.k + got.v, export.k + export.v))
    with pytest.raises(InputError, match=rf"export_kv: dst .* must be <= {size - 1}, got {size}"):
        eng.export_kv(out.handles[2], dst=size)  # one line, on every rank
    for h in out.handles:
        eng.release(h)
    return out, export


def _job(group, folders, cases):
    res = []
    for tp, cp, pp, *case in cases:
        family, dtype, layout, kv_cache, graph, moe = case
        eng = mesh_engine(group, folders, BUCKETS, ParallelConfig(tp_size=tp, cp_size=cp, pp_size=pp), *case, AUX)
        out, export = _run(eng, group.rank, group.size)
        st = eng.stats()
        last = st["forwards"][-1]
        res.append((out.last_logits, out.logits, out.aux_hidden, out.info.path,
                    {k: st[k] for k in ("mesh", "kv_heads", "attn_tp_size")}, eng.parts.kv.pool_bytes,
                    (last["bytes_received_per_layer"], out.info.capacity), export.k + export.v))
    return res


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return {"qwen3": hf_model_dir("qwen3"), "qwen3_moe": hf_model_dir("qwen3_moe"),
            "qwen3_moe-all": hf_model_dir("qwen3_moe", num_experts_per_tok=8), "llama": hf_model_dir("llama"),
            "mixtral": hf_model_dir("mixtral")}


@pytest.fixture(scope="module")
def results(folders):
    return launch(_job, 4, folders, CASES, timeout_s=300)


@pytest.fixture(scope="module")
def single(folders):
    """The single-rank run of each (family, dtype)."""
    out = {}
    for family, dtypes in (("qwen3", TOL), ("qwen3_moe", TOL), ("llama", TOL), ("mixtral", ("float32",))):
        for dtype in dtypes:
            rt = RuntimeConfig(dtype=dtype, kv_tokens=1024, aux_hidden_layers=AUX)
            o, export = _run(PrefillEngine(folders[twin_of(family, dtype)], rt))
            out[family, dtype] = (o.last_logits, o.logits, o.aux_hidden, export.k + export.v)
    return out


def test_attention_tp_equals_a_single_rank(results, single):
    for case, rank_results in zip(CASES, zip(*results)):
        tp, cp, pp, family, dtype, layout, kv_cache, graph, moe = case
        rlast, rlogits, raux, rkv = single[family, dtype]
        for rank, (last, logits, aux, path, mesh, _, _, kv) in enumerate(rank_results):
            assert len(kv) == len(rkv)
            for a, b in zip(kv, rkv):  # the export holds every KV head, in the model's order
                assert a.shape == b.shape and rel_err(a, b) <= TOL[dtype], (case, rank)
            assert path == ("eager" if graph == "off" else "graph"), case
            assert rel_err(last, rlast) <= TOL[dtype], (case, rank, rel_err(last, rlast))
            for a, b in zip(logits, rlogits):
                assert rel_err(a, b) <= TOL[dtype], (case, rank)
            for a, b in zip(aux, raux):
                assert rel_err(a, b) <= TOL[dtype], (case, rank)
            A = tp // cp
            stage, i = divmod(rank, tp)
            assert mesh == {"mesh": {"stage": stage, "dp": 0, "cp": i // A, "attn_tp": i % A},
                            "kv_heads": 2 // A if A <= 2 else 1, "attn_tp_size": A}, case
        # every rank returns the same outputs
        for last, *_ in rank_results[1:]:
            assert torch.equal(last, rank_results[0][0]), case


def test_a_rank_stores_and_receives_its_heads_only(results, folders):
    """At attention TP 2 a rank's KV pool and the KV bytes it receives per layer (the
    stats, the replicated cache's all-gather over CP) are half of attention TP 1's: the
    formula at the rank's KV heads, and half of it at the model's."""
    cfg = ModelConfig.from_file(folders["qwen3"] / "config.json")
    pool = {(c[0] // c[1], c[6]): r[0][5] for c, r in zip(CASES, zip(*results)) if c[3] == "qwen3"
            and c[4] == "float32" and c[2] == 1}
    assert pool[2, "replicated"] * 2 == pool[1, "replicated"]
    checked = 0
    for case, rank_results in zip(CASES, zip(*results)):
        tp, cp, pp, family, dtype, _, kv_cache, _, _ = case
        if kv_cache != "replicated" or pp != 1 or cp == 1 or family != "qwen3":
            continue
        itemsize = 4 if dtype == "float32" else 2
        for r in rank_results:
            got, capacity = r[6]
            mine = exchanged_bytes_per_layer(capacity, cp, r[4]["kv_heads"], cfg.head_dim, itemsize)
            whole = exchanged_bytes_per_layer(capacity, cp, cfg.num_kv_heads, cfg.head_dim, itemsize)
            assert got == mine == whole * r[4]["kv_heads"] // cfg.num_kv_heads, case
            checked += 1
    assert checked >= 6


def test_attention_tp_matches_transformers(results, folders, hf_model):
    for case, rank_results in zip(CASES, zip(*results)):
        if case[4] != "float32" or case[0] // case[1] == 1:
            continue
        hf = hf_model(folders[case[3]])
        logits = rank_results[0][1]
        for (prefix, new), got in zip(_batch(hf.config.vocab_size), logits):
            full = new if prefix is None else np.concatenate([prefix, new])
            with torch.no_grad():
                want = hf(torch.as_tensor(full)[None]).logits[0, -len(new):].float()
            assert rel_err(got, want) <= HF_TOL, case


def test_the_memory_estimate_counts_the_ranks_kv_heads(hf_model_dir):
    """--memory-check sizes a rank's KV pool with its own KV heads: half at attention TP 2."""
    from graphcp.jobs.memory import job_memory
    from graphcp.jobs.spec import JobSpec

    folder = str(hf_model_dir("qwen3"))
    rt = RuntimeConfig(kv_tokens=4096)
    one, two = (job_memory(JobSpec(folder, rt, cp_size=2, tp_size=tp), [1024]) for tp in (2, 4))
    assert two.kv_pool * 2 == one.kv_pool and two.weights < one.weights


def test_meshes_that_do_not_split_are_refused(hf_model_dir):
    """Heads that do not split, a DSA model under attention TP: one-line ConfigErrors naming the degree (the engine and the CLI's preflight both
    check through ModelConfig.check_parallel)."""
    def check(folder, **kw):
        ModelConfig.from_file(folder / "config.json").check_parallel(ParallelConfig(**kw))

    dense = hf_model_dir("qwen3")
    with pytest.raises(ConfigError, match=r"num_attention_heads=4 does not divide by attention TP 8"):
        check(dense, tp_size=8)
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2 neither divides by attention TP 3"):
        check(hf_model_dir("qwen3", num_attention_heads=6, num_key_value_heads=2, intermediate_size=96), tp_size=3)
    with pytest.raises(ConfigError, match=r"a DSA \(MLA\) model runs attention TP 1 under CP"):
        check(hf_model_dir("deepseek_v32"), tp_size=2)
    # the experts split over all tp_size ranks: the error names that degree (8 experts over 16)
    with pytest.raises(ConfigError, match=r"num_experts=8 does not divide by tp_size=16.*num_experts / tp_size"):
        check(hf_model_dir("qwen3_moe", num_attention_heads=16, num_key_value_heads=16, head_dim=8,
                           intermediate_size=256), tp_size=16, cp_size=2)
