"""Pipeline parallelism across CP groups equals the single-rank engine and
transformers: PP 2 x CP 1 and PP 2 x CP 2, two families, float32 and bfloat16,
mixed lengths with prefix extends, 1 and 4 micro-batches (the prefixes are
micro-batched too: a long request then runs as chunks across the stages), an
uneven --pp-layers split, and breakable graphs on every stage (each stage's replay
bitwise equal to its eager body on the same bucket); MoE layers on both stages. One
launch per PP x CP shape; the configurations loop inside the ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cp_utils import batch, rel_err, run_batch, write_tiny_llama

from graphcp import ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.cli.jobs import compare_paths
from graphcp.dist import launch
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import prefill_after_prefixes

LENS = [97, 1, 5, 33, 2]
PREFIX = [0, 0, 40, 0, 3]
TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # vs the single-rank engine
HF_TOL = {"float32": 1e-4, "bfloat16": 2e-2}  # vs transformers (as tests/test_cp_exactness.py)
AUX = {"qwen3": (3, 0, 1), "llama": (1, 0)}  # asked out of layer order: columns come back as asked
BUCKETS = BucketSet((16, 32, 64, 128, 256), padding_factor=64.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory, hf_model_dir):
    # the tiny tied Qwen3 with the default preset's 4 layers (the splits below need them),
    # at a sixteenth of the preset's work (hidden 64, vocab 512)
    return {"qwen3": str(hf_model_dir("qwen3", True, num_hidden_layers=4)),
            "llama": str(write_tiny_llama(tmp_path_factory.mktemp("llama")))}


def _batch(vocab: int):
    return batch(np.random.default_rng(7), vocab, LENS, PREFIX)


def _cases(models, cp: int):
    """(family, dtype, micro-batches, pp_layers, graph) run in one launch: each family in
    both dtypes, each (family, dtype) with 1 or 4 micro-batches and each family with both."""
    cases = [("qwen3", "float32", 1, None, "off"), ("qwen3", "bfloat16", 4, None, "off"),
             ("llama", "float32", 4, None, "off"), ("llama", "bfloat16", 1, None, "off")]
    if cp == 1:
        cases += [("qwen3", "float32", 4, (3, 1), "off"),  # an uneven split
                  ("qwen3", "float32", 4, None, "breakable"), ("qwen3", "bfloat16", 1, (1, 3), "breakable")]
    return cases


def _job(group, models, cases, cp: int):
    out = []
    for family, dtype, m, layers, graph in cases:
        # no capture self-check: the same-bucket comparisons below are this test's own
        # (tests/test_aux_hidden.py runs PP 2 graphs with the self-check on)
        rt = RuntimeConfig(dtype=dtype, kv_tokens=4096, microbatches=m, graph=graph, aux_hidden_layers=AUX[family],
                           verify_capture=False)
        eng = PrefillEngine(models[family], rt, group, BUCKETS, ParallelConfig(cp_size=cp, pp_size=2, pp_layers=layers))
        res = run_batch(eng, _batch(eng.cfg.vocab_size))
        bitwise = _stage_replay_bitwise(eng) if graph != "off" else None
        # `graphcp run`'s comparison under PP: every stage's same-bucket check, combined
        cmp = compare_paths(eng, [t for _, t in _batch(eng.cfg.vocab_size)[:2]]) if graph != "off" else None
        out.append((res.last_logits, res.logits, res.aux_hidden, res.info.path, bitwise, eng.parts.kv.snapshot(), cmp))
    return out


def _stage_replay_bitwise(eng) -> bool:
    """This stage's replay against its own eager body on the same bucket (a later
    stage's input rows seeded): the body rows and the auxiliary rows, bitwise."""
    rng = np.random.default_rng(5)
    reqs = [Request(rng.integers(0, eng.cfg.vocab_size, n)) for n in (50, 7, 1)]
    prep = eng.parts.preparer.prepare(reqs)
    try:
        rows = eng.parts.runner.prefill.synthetic_input(prep, rng)
        sel = eng.parts.runner.select(prep.plan.max_local_rows)
        if sel.capacity not in eng.parts.runner.graphs:  # capture first: it refills the static buffers
            eng.parts.runner.capture_bucket(sel.capacity)
        same = eng.parts.runner.eager_on_bucket(prep, sel.capacity, rows).clone()
        aux = eng.parts.runner.aux_rows(sel.capacity).clone()  # every stage holds some of AUX here
        hidden, info = eng.parts.runner.try_replay(prep, rows)
        return info.path == "graph" and torch.equal(hidden, same) and torch.equal(eng.parts.runner.aux_rows(sel.capacity), aux)
    finally:
        eng.parts.preparer.abort(prep)


@pytest.fixture(scope="module")
def references(models):
    """The single-rank engine's outputs and transformers' logits, per family and dtype."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for family, folder in models.items():
        for dtype in ("float32", "bfloat16"):
            eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=4096, aux_hidden_layers=AUX[family]))
            one = run_batch(eng, _batch(eng.cfg.vocab_size))
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
            hf_logits = []
            with torch.inference_mode():
                for prefix, new in _batch(eng.cfg.vocab_size):
                    full = new if prefix is None else np.concatenate([prefix, new])
                    hf_logits.append(hf(torch.as_tensor(full)[None]).logits[0, -len(new):].float())
            refs[family, dtype] = (one, hf_logits)
    return refs


@pytest.mark.parametrize("cp", [1, 2])
def test_pp2_equals_single_rank_and_transformers(models, references, cp):
    cases = _cases(models, cp)
    results = launch(_job, 2 * cp, models, cases, cp)
    for rank, per_case in enumerate(results):
        for (family, dtype, m, layers, graph), (last, logits, aux, path, bitwise, snap, cmp) in zip(cases, per_case):
            where = f"rank {rank} (stage {rank // cp}), {family} {dtype}, M={m}, pp_layers={layers}, graph={graph}"
            one, hf = references[family, dtype]
            assert rel_err(last, one.last_logits) <= TOL[dtype], where
            assert [x.shape for x in logits] == [x.shape for x in one.logits], where
            for j, (got, want, ref) in enumerate(zip(logits, one.logits, hf)):
                assert rel_err(got, want) <= TOL[dtype], f"{where}, request {j}"
                assert rel_err(got, ref) <= HF_TOL[dtype], f"{where}, request {j} vs transformers"
            for j, (got, want) in enumerate(zip(aux, one.aux_hidden)):
                assert rel_err(got, want) <= TOL[dtype], f"{where}, request {j} auxiliary hidden states"
            if graph != "off":
                assert path == "graph" and bitwise, where
                assert cmp["path"] == "graph" and cmp["same_bucket_bitwise"] is True, (where, cmp)
                assert cmp["rel_diff"] <= TOL[dtype], (where, cmp)
            # every rank of the pipeline returns the same outputs and keeps the same KV allocator state
            assert torch.equal(last, results[0][cases.index((family, dtype, m, layers, graph))][0]), where
            assert snap == results[0][cases.index((family, dtype, m, layers, graph))][5], where


def _moe_job(group, cases):
    out = []
    for moe, graph in cases:
        rt = RuntimeConfig(kv_tokens=4096, moe=moe, graph=graph, aux_hidden_layers=(3, 0), verify_capture=False)
        eng = PrefillEngine("default-moe", rt, group, BUCKETS, ParallelConfig(pp_size=2))
        res = prefill_after_prefixes(eng, _batch(eng.cfg.vocab_size), all_logits=True, microbatches=2)
        out.append((res.last_logits, res.logits, res.aux_hidden, res.info.path))
    return out


def test_pp2_with_moe_layers_equals_single_rank():
    """MoE layers on both stages (experts over each stage's CP group: ep, and tp),
    micro-batched, eager and breakable (ep's exchange break on each stage)."""
    cases = [("ep", "off"), ("ep", "breakable"), ("tp", "off")]
    ref = PrefillEngine("default-moe", RuntimeConfig(kv_tokens=4096, aux_hidden_layers=(3, 0)))
    one = run_batch(ref, _batch(ref.cfg.vocab_size))
    for rank, per_case in enumerate(launch(_moe_job, 2, cases)):
        for (moe, graph), (last, logits, aux, path) in zip(cases, per_case):
            where = f"rank {rank}, moe={moe}, graph={graph}"
            assert path == ("graph" if graph != "off" else "eager"), where
            assert rel_err(last, one.last_logits) <= TOL["float32"], where
            for got, want in zip(logits, one.logits):
                assert rel_err(got, want) <= TOL["float32"], where
            for got, want in zip(aux, one.aux_hidden):
                assert rel_err(got, want) <= TOL["float32"], where


def _uneven_job(group, folder, dtype):
    eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=4096, microbatches=2), group,
                        parallel=ParallelConfig(pp_size=3))  # 4 layers over 3 stages, no --pp-layers
    return list(eng.parts.model.stage.layers), run_batch(eng, _batch(eng.cfg.vocab_size)).logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layers_that_do_not_divide_split_by_default(models, references, dtype):
    """PP 3 over the 4-layer model without --pp-layers: the extra layer goes to the stage
    before the last (config.default_stage_counts) and the logits are the single rank's."""
    ranks = launch(_uneven_job, 3, models["qwen3"], dtype)
    assert [layers for layers, _ in ranks] == [[0], [1, 2], [3]]
    one, _ = references["qwen3", dtype]
    for _, logits in ranks:
        for got, want in zip(logits, one.logits):
            assert rel_err(got, want) <= TOL[dtype]
