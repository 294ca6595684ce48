"""Generated bad batches for ``PrefillEngine.prefill`` (a seeded generator), at CP 1
(float32 and bfloat16) and CP 2 (two gloo ranks, float32). Every case must raise a
``BatchError`` (the one family: wrong types, bad ids, bad handles, context, pool),
leave the KV cache bitwise unchanged (allocator state and pool contents), and every
tenth case a good batch (a cached prefix extended, plus a fresh request) must still
give the reference logits: bitwise those of the same engine before any bad input,
and at CP 2 within 1e-5 of the single-rank run.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from helpers import rel_err

from graphcp import PrefillEngine, Request
from graphcp.config import RuntimeConfig
from graphcp.dist import launch
from graphcp.errors import BatchError
from graphcp.kv.handle import KVHandle

VOCAB, CONTEXT, POOL, PAGE = 512, 4096, 256, 16  # conftest.py's tiny qwen2; a 16-page pool
SEED = 2024
MIN_CASES = 55


def _ids(rng: random.Random, n: int) -> np.ndarray:
    return np.array([rng.randrange(VOCAB) for _ in range(n)], dtype=np.int64)


def _cases(rng: random.Random, h: dict) -> list[tuple[str, object]]:
    """(name, batch) pairs; ``h`` holds handles: live, stale, released, foreign."""
    t = _ids(rng, rng.randrange(2, 30))
    R = Request
    cases: list[tuple[str, object]] = [
        # the batch itself is not a list of requests
        ("batch=Request", R(t)), ("batch=dict", {"tokens": t}), ("batch=int", 5), ("batch=None", None),
        ("batch=str", "abc"), ("batch=generator", (R(t) for _ in range(2))), ("batch=ndarray", np.arange(3)),
        ("batch=bytes", b"\x01\x02"), ("batch=[]", []), ("batch=()", ()),
        # items that are not requests
        ("item=list", [[1, 2]]), ("item=tuple", [(1, 2)]), ("item=ndarray", [np.arange(3)]), ("item=int", [5]),
        ("item=None", [None]), ("item=dict", [{"tokens": [1]}]), ("item=str-after-good", [R(t), "x"]),
        ("item=tensor", [torch.arange(3)]),
        # token containers that are not 1-D integer ids
        ("tokens=floats", [R([1.0, 2.0])]), ("tokens=float32", [R(np.ones(4, dtype=np.float32))]),
        ("tokens=2-D", [R(np.ones((2, 3), dtype=np.int64))]), ("tokens=ragged", [R([[1, 2], [3]])]),
        ("tokens=strings", [R(["a", "b"])]), ("tokens=None-inside", [R([1, None])]),
        ("tokens=bool", [R(np.array([True, False]))]), ("tokens=2**70", [R([1, 2**70])]),
        ("tokens=uint64-max", [R(np.array([1, 2**64 - 1], dtype=np.uint64))]),
        ("tokens=float-tensor", [R(torch.ones(3))]), ("tokens=bf16-tensor", [R(torch.ones(3, dtype=torch.bfloat16))]),
        ("tokens=bool-tensor", [R(torch.ones(3, dtype=torch.bool))]),
        ("tokens=2-D-tensor", [R(torch.ones(2, 2, dtype=torch.long))]), ("tokens=[]", [R(t), R([])]),
        ("tokens=empty-array", [R(np.zeros(0, dtype=np.int64))]), ("tokens=str", [R("abc")]), ("tokens=int", [R(7)]),
        # prefixes that are not this engine's live, current handles
        ("prefix=int", [R(t, prefix=3)]), ("prefix=list", [R(t, prefix=[1, 2])]), ("prefix=str", [R(t, prefix="h")]),
        ("prefix=dict", [R(t, prefix={"seq_id": 0})]), ("prefix=released", [R(t, prefix=h["released"])]),
        ("prefix=stale", [R(t), R(t, prefix=h["stale"])]), ("prefix=foreign", [R(t, prefix=h["foreign"])]),
        ("prefix=forged-no-issuer", [R(t, prefix=KVHandle(h["live"].seq_id, h["live"].num_tokens, h["live"].pages))]),
        ("prefix=forged-issuer", [R(t, prefix=dataclasses.replace(h["live"], cache_id="0" * 32))]),
        ("prefix=wrong-count", [R(t, prefix=dataclasses.replace(h["live"], num_tokens=h["live"].num_tokens + 1))]),
        ("prefix=twice", [R(t, prefix=h["live"]), R(_ids(rng, 3)), R(t, prefix=h["live"])]),
        # lengths: the model's context, the pool, the free pages
        ("context", [R(_ids(rng, CONTEXT + 1))]), ("context+prefix", [R(_ids(rng, CONTEXT - 10), prefix=h["live"])]),
        ("pool", [R(_ids(rng, POOL + 1))]), ("pool+prefix", [R(_ids(rng, POOL - 30), prefix=h["live"])]),
        ("free-pages", [R(_ids(rng, 100)), R(_ids(rng, 100))]),
        ("free-pages+prefix", [R(_ids(rng, 150)), R(_ids(rng, 60), prefix=h["live"])]),  # 10 + 4 pages, 13 free
        ("free-pages-many", [R(_ids(rng, 17)) for _ in range(13)]),
    ]
    for i in range(8):  # an id outside the vocabulary at a random place of a random batch
        batch = [_ids(rng, rng.randrange(1, 40)) for _ in range(rng.randrange(1, 5))]
        j = rng.randrange(len(batch))
        batch[j][rng.randrange(len(batch[j]))] = rng.choice([VOCAB, VOCAB + rng.randrange(10**6), -1, -(2**40), 2**62])
        cases.append((f"vocab-{i}", [R(x) for x in batch]))
    return cases


def _good(engine: PrefillEngine, rng_seed: int):
    """A prefix prefilled, then extended beside a fresh request: logits of the second forward."""
    rng = random.Random(rng_seed)
    first = engine.prefill([Request(_ids(rng, 30))])
    out = engine.prefill([Request(_ids(rng, 21), prefix=first.handles[0]), Request(_ids(rng, 37))], all_logits=True)
    for hd in out.handles:
        engine.release(hd)
    return out.last_logits, out.logits


def _api_job(group, model: str, dtype: str) -> dict:
    rt = RuntimeConfig(dtype=dtype, kv_tokens=POOL, page_size=PAGE)
    engine, other = PrefillEngine(model, rt, group), PrefillEngine(model, rt, group)
    ref = _good(engine, 1)
    rng = random.Random(SEED)
    old = engine.prefill([Request(_ids(rng, 20))]).handles[0]
    live = engine.prefill([Request(_ids(rng, 20), prefix=old)]).handles[0]  # `old` is stale from here on
    released = engine.prefill([Request(_ids(rng, 5))]).handles[0]
    engine.release(released)
    handles = {"live": live, "stale": old, "released": released,
               "foreign": other.prefill([Request(_ids(rng, 40))]).handles[0]}
    results, good = [], []
    for i, (name, batch) in enumerate(_cases(rng, handles)):
        snap, pool = engine.parts.kv.snapshot(), engine.parts.kv.pool.clone()
        try:
            engine.prefill(batch)
            outcome = "accepted"
        except BatchError as e:
            outcome = "BatchError" if str(e) and "\n" not in str(e) else f"BatchError without a one-line message: {e!r}"
        except Exception as e:  # noqa: BLE001 - reported as the wrong error
            outcome = f"{type(e).__name__}: {e}"
        results.append((name, outcome, engine.parts.kv.snapshot() == snap and torch.equal(engine.parts.kv.pool, pool)))
        if i % 10 == 9:
            good.append(_good(engine, 1))
    return {"results": results, "ref": ref, "good": good}


def _check(res: dict, where: str) -> None:
    assert len(res["results"]) >= MIN_CASES
    bad = [f"{name}: {outcome}, KV unchanged={same}" for name, outcome, same in res["results"]
           if outcome != "BatchError" or not same]
    assert not bad, f"{where}: {len(bad)} of {len(res['results'])} cases broke the contract:\n" + "\n".join(bad)
    ref_last, ref_all = res["ref"]
    assert len(res["good"]) >= 5
    for last, logits in res["good"]:  # the same engine, the same batch: the same bits
        assert torch.equal(last, ref_last) and all(torch.equal(a, b) for a, b in zip(logits, ref_all)), where


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):
    return str(hf_model_dir("qwen2", False, "float32"))


@pytest.fixture(scope="module")
def single_rank(model_dir):
    from graphcp.dist import CPGroup

    return {dtype: _api_job(CPGroup(), model_dir, dtype) for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generated_bad_batches_cp1(single_rank, dtype):
    _check(single_rank[dtype], f"CP 1 {dtype}")


def test_generated_bad_batches_cp2(single_rank, model_dir):
    ranks = launch(_api_job, 2, model_dir, "float32")
    one = single_rank["float32"]
    for r, res in enumerate(ranks):
        _check(res, f"CP 2 rank {r}")
        assert [n for n, _, _ in res["results"]] == [n for n, _, _ in one["results"]]
        # CP 2 computes what one rank computes
        assert rel_err(res["ref"][0], one["ref"][0]) < 1e-5
        assert all(rel_err(a, b) < 1e-5 for a, b in zip(res["ref"][1], one["ref"][1]))
    assert torch.equal(ranks[0]["ref"][0], ranks[1]["ref"][0])  # identical logits on every rank
