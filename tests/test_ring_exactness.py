"""The sharded cache's rings are exact: at CP 2 and 4, pass-KV, pass-Q and auto, in
float32 and bfloat16, on GQA, MHA and MQA checkpoints, for mixed lengths (single
tokens, fewer than 2C, long) and chunked prefill whose prefix (itself sharded over
the ranks) came from earlier forwards: every token's logits equal the replicated
engine's (1e-5 float32, 2e-2 bfloat16) and transformers' (tests/test_hf_parity.py's
bounds). One launch per CP size; the configurations loop inside the ranks. A
mixture-of-experts model with expert parallelism (attention and the MoE exchange in one
break a layer) runs the rings there too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import rel_err

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
HF_TOL = {"float32": 1e-4, "bfloat16": 2e-2}
#: (family, KV heads of 4 query heads): GQA, MHA, MQA
CHECKPOINTS = [("qwen3", 2), ("llama", 4), ("mistral", 1)]
EXCHANGES = ("pass-kv", "pass-q", "auto")


def _chunks(cp: int, vocab: int):
    """Three forwards: fresh requests (1 token, 2C - 1 tokens, long ones), then two of
    them extended (a sharded prefix), then one extended again (a prefix of two chunks)."""
    rng = np.random.default_rng(cp)
    first = [rng.integers(0, vocab, n) for n in (1, 2 * cp - 1, 300, 77, 5)]
    second = [(0, rng.integers(0, vocab, 129)), (3, rng.integers(0, vocab, 1)), (None, rng.integers(0, vocab, 2))]
    third = [(0, rng.integers(0, vocab, 2 * cp + 1))]
    return first, second, third


def _run(engine, cp: int):
    """Every forward's logits (all tokens) and exchange; releases everything."""
    first, second, third = _chunks(cp, engine.cfg.vocab_size)
    outs = []
    a = engine.prefill([Request(t) for t in first], all_logits=True)
    b = engine.prefill([Request(t, None if j is None else a.handles[j]) for j, t in second], all_logits=True)
    c = engine.prefill([Request(t, b.handles[j]) for j, t in third], all_logits=True)
    for o in (a, b, c):
        outs.append((o.logits, o.info.stats["exchange"], o.info.stats["bytes_received"]))
    for h in [a.handles[j] for j in (1, 2, 4)] + [b.handles[1], b.handles[2], c.handles[0]]:
        engine.release(h)
    return outs, engine.parts.kv.stored_tokens()


def _job(group, folders):
    report = []
    for folder in folders:
        for dtype in ("float32", "bfloat16"):
            ref = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=2048), group)
            want, _ = _run(ref, group.size)
            for exchange in EXCHANGES:
                eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=2048, kv_cache="sharded",
                                                         exchange=exchange), group)
                got, left = _run(eng, group.size)
                errs = [max(rel_err(x, y) for x, y in zip(g[0], w[0])) for g, w in zip(got, want)]
                keep = [g[0] for g in got] if group.rank == 0 and exchange == "auto" else None
                report.append((str(folder), dtype, exchange, errs, [g[1] for g in got], [g[2] for g in got],
                               left, keep))
    return report


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return [hf_model_dir(f, False, "float32", num_key_value_heads=kv) for f, kv in CHECKPOINTS]


@pytest.mark.parametrize("cp", [2, 4])
def test_rings_equal_the_replicated_engine_and_transformers(cp, folders, hf_model):
    results = launch(_job, cp, folders)
    hf_refs = {}
    for rank, report in enumerate(results):
        for folder, dtype, exchange, errs, ran, received, left, keep in report:
            where = f"CP {cp} rank {rank}, {folder}, {dtype}, {exchange}"
            assert max(errs) <= TOL[dtype], f"{where}: vs the replicated engine {errs}"
            assert left == 0, where  # every handle released on every rank
            assert all(b > 0 for b in received), where  # every forward's ring moved bytes
            if exchange != "auto":
                assert ran == [exchange] * 3, where
            else:  # fresh prompts: pass-KV (no more bytes); a (2C + 1)-token extend of 381 cached: pass-Q
                assert ran[0] == "pass-kv" and ran[2] == "pass-q", (where, ran)
            if keep is None:
                continue
            model = hf_model(folder, dtype)
            if (folder, dtype) not in hf_refs:
                hf_refs[(folder, dtype)] = _hf_logits(model, cp)
            for got, want in zip([x for forward in keep for x in forward], hf_refs[(folder, dtype)]):
                assert rel_err(got, want) <= HF_TOL[dtype], f"{where}: vs transformers {rel_err(got, want)}"
    assert len(hf_refs) == 2 * len(CHECKPOINTS)


@torch.inference_mode()
def _hf_logits(model, cp: int) -> list[torch.Tensor]:
    """transformers' logits of every new token of every forward of :func:`_chunks`."""
    first, second, third = _chunks(cp, model.config.vocab_size)
    seqs = [list(t) for t in first]
    out = [model(torch.as_tensor(s)[None]).logits[0].float() for s in seqs]
    history = {j: list(first[j]) for j in range(len(first))}
    for k, (j, t) in enumerate(second):
        prev = history.get(j, []) if j is not None else []
        full = prev + list(t)
        out.append(model(torch.as_tensor(full)[None]).logits[0, len(prev):].float())
        history[("b", k)] = full
    for j, t in third:
        prev = history[("b", j)]
        out.append(model(torch.as_tensor(prev + list(t))[None]).logits[0, len(prev):].float())
    return out


def _moe_job(group):
    """A mixture-of-experts model whose experts are split over the ranks (its attention
    and MoE exchange share one break a layer): the ring runs in that break."""
    outs = {}
    for kv_cache in ("replicated", "sharded"):
        eng = PrefillEngine("default-moe", RuntimeConfig(kv_tokens=2048, kv_cache=kv_cache, moe="ep"), group)
        rng = np.random.default_rng(1)
        a = eng.prefill([Request(rng.integers(0, 100, n)) for n in (50, 3)], all_logits=True)
        b = eng.prefill([Request(rng.integers(0, 100, 9), a.handles[0])], all_logits=True)
        outs[kv_cache] = (a.logits + b.logits, [o.info.stats["exchange"] for o in (a, b)],
                          [o.info.stats["moe_bytes_received"] for o in (a, b)])
    return outs


def test_rings_run_inside_the_expert_parallel_break():
    for rank, outs in enumerate(launch(_moe_job, 2)):
        (want, _, moe_want), (got, ran, moe_got) = outs["replicated"], outs["sharded"]
        assert ran == ["pass-kv", "pass-q"] and moe_got == moe_want, (rank, ran, moe_got, moe_want)
        errs = [rel_err(x, y) for x, y in zip(got, want)]
        assert max(errs) <= TOL["float32"], (rank, errs)
