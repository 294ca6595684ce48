"""A decode step's bookkeeping and refusals (issue 40, docs/decode.md).

The caches' decode reservation, simulated for C ranks in one process (every rank runs the
same calls, as SPMD ranks do): where each decoded token lands, the ledger every rank keeps
the same, its rollback; then ``engine.decode``'s refusals: each one line (a BatchError)
that leaves the cache as it was.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import kv_cache

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.errors import BatchError
from graphcp.kv.decode import EVERY_RANK, decode_owner, decoded_positions
from graphcp.kv.handle import KVHandleError
from graphcp.kv.paged import PagedKVCache

PAGE = 4


def _sharded(cp: int, pages: int = 40) -> list[PagedKVCache]:
    return [kv_cache("sharded", 1, pages, PAGE, 1, 2, cp_size=cp, rank=r) for r in range(cp)]


def _step(caches, handles):
    """One decode step of every request on every rank: the reservations, the new handles."""
    got = [c.reserve_decode(h, c.prefix_rows(h)) for c, h in zip(caches, handles)]
    return got, [[c.handle(s) for s in g.seq_ids] for c, g in zip(caches, got)]


def test_the_owner_is_the_least_loaded_rank_round_robin_among_equals():
    held = np.array([[3, 3, 3, 3], [3, 3, 3, 3], [4, 2, 4, 2], [1, 5, 5, 5]])
    assert decode_owner(held, np.array([12, 13, 14, 16])).tolist() == [0, 1, 3, 0]
    # from equal counts the positions go round-robin over the ranks
    h = np.zeros((1, 4), dtype=np.int64)
    owners = []
    for p in range(8):
        owners.append(int(decode_owner(h, np.array([p]))[0]))
        h[0, owners[-1]] += 1
    assert owners == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("cp", [2, 4])
def test_sharded_decode_tokens_land_on_one_rank_and_the_ledger_agrees(cp):
    caches = _sharded(cp)
    ids = [c.extend([None, None, None], [7, 13, 1]) for c in caches]
    handles = [[c.handle(i) for i in row] for c, row in zip(caches, ids)]
    for _ in range(3 * cp + 1):
        before = handles[0]
        steps, handles = _step(caches, handles)
        holder = steps[0].holder
        assert all(np.array_equal(s.holder, holder) for s in steps)  # every rank decides alike
        for r, s in enumerate(steps):
            assert np.array_equal(s.positions, [h.num_tokens for h in before])
            assert np.array_equal(s.slots >= 0, holder == r)  # one rank writes each token
            assert np.array_equal(s.local_lens, [h.local_tokens(r) for h in handles[r]])
        assert all(h.holding.decoded == handles[0][j].holding.decoded for hs in handles for j, h in enumerate(hs))
    for j, h in enumerate(handles[0]):
        held = [h.positions(r) for r in range(cp)]
        assert [len(p) for p in held] == list(h.holding.rank_tokens)
        assert all(np.all(np.diff(p) > 0) for p in held)  # local order is position order
        assert np.array_equal(np.sort(np.concatenate(held)), np.arange(h.num_tokens))
        assert max(h.holding.rank_tokens) - min(h.holding.rank_tokens) <= 1, h.holding.rank_tokens  # evened out
    assert sum(c.stored_tokens() for c in caches) == sum(h.num_tokens for h in handles[0])
    used = caches[0].placement.rank_used_pages()
    assert [c.stored_pages() for c in caches] == used.tolist()
    # a next turn's chunk after the decoded tokens: still a partition, in position order
    ids = [c.extend(h, [9, 2, 5]) for c, h in zip(caches, handles)]
    for j in range(3):
        h = caches[0].handle(ids[0][j])
        held = np.concatenate([caches[r].handle(ids[r][j]).positions(r) for r in range(cp)])
        assert np.array_equal(np.sort(held), np.arange(h.num_tokens))
        assert len(h.positions(0)) == h.holding.rank_tokens[0]


@pytest.mark.parametrize("cp", [1, 4])
def test_a_failed_decode_step_rolls_back_on_every_rank(cp):
    caches = _sharded(cp)
    ids = [c.extend([None, None], [5, 2]) for c in caches]
    handles = [[c.handle(i) for i in row] for c, row in zip(caches, ids)]
    _, handles = _step(caches, handles)
    snaps = [c.snapshot() for c in caches]
    steps, _ = _step(caches, handles)
    for c, s in zip(caches, steps):  # the fast undo (nothing changed since)
        c.rollback_decode(s)
    assert [c.snapshot() for c in caches] == snaps
    steps, _ = _step(caches, handles)
    for c, s in zip(caches, steps):  # the general undo (something changed since)
        c.allocator.last = None
        c.rollback_decode(s)
    assert [c.snapshot() for c in caches] == snaps


@pytest.mark.parametrize("mode", ["replicated", "layer-split"])
def test_replicated_and_layer_split_store_a_decoded_token_on_every_rank(mode):
    split = mode == "layer-split"
    kw = dict(rank=1, cp_size=2) if split else {}
    c = kv_cache(mode, 2, 20, PAGE, 1, 2, **kw)
    h = [c.handle(i) for i in c.extend([None, None], [3, 4])]
    snap = c.snapshot()
    s = c.reserve_decode(h, c.prefix_rows(h))
    assert s.holder.tolist() == [EVERY_RANK] * 2 and s.positions.tolist() == [3, 4]
    assert s.local_lens.tolist() == [4, 5] and (s.slots > 0).all()
    assert c.attention_holder(0) == (0 if split else None)
    c.rollback_decode(s)
    assert c.snapshot() == snap


def test_decoded_positions_follow_the_runs():
    # 6 tokens decoded from counts (1, 2, 2, 2): rank 0 first, then round-robin
    runs = ((7, 6, (1, 2, 2, 2)),)
    assert [decoded_positions(runs, r).tolist() for r in range(4)] == [[7, 8, 12], [9], [10], [11]]


# ---- engine.decode's refusals ------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(hf_model_dir):
    folder = hf_model_dir("qwen3", False, "float32")
    return {mode: PrefillEngine(folder, RuntimeConfig(kv_tokens=4352, kv_cache=mode, page_size=PAGE))
            for mode in ("replicated", "sharded")}


def _refused(engine, handles, tokens, exc, match):
    snap = engine.parts.kv.snapshot()
    with pytest.raises(exc, match=match) as e:
        engine.decode(handles, tokens)
    assert "\n" not in str(e.value) and engine.parts.kv.snapshot() == snap


@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_bad_decode_steps_are_one_line_and_change_nothing(engines, mode):
    eng = engines[mode]
    other = engines["sharded" if mode == "replicated" else "replicated"]
    out = eng.prefill([Request([1, 2, 3]), Request([4, 5])])
    a, b = out.handles
    foreign = other.prefill([Request([1, 2, 3])]).handles[0]
    try:
        _refused(eng, [a, b], [7, 512], BatchError, r"decode: request 1: token id 512 is outside the vocabulary")
        _refused(eng, [a, b], [-1, 3], BatchError, r"request 0: token id -1 is outside")
        _refused(eng, [a, b], [1.5, 2.0], BatchError, r"tokens must be one integer id per request")
        _refused(eng, [a, b], [1], BatchError, r"one integer id per request \(2\)")
        _refused(eng, [], [], BatchError, r"empty batch")
        _refused(eng, [a, None], [1, 2], KVHandleError, r"request 1: expected a KVHandle")
        _refused(eng, [a, a], [1, 2], KVHandleError, r"requests 0 and 1 are the same sequence")
        _refused(eng, [a, foreign], [1, 2], KVHandleError, r"request 1: .*issued by another KV cache")
        step = eng.decode([a, b], [6, 7])
        _refused(eng, [a], [1], KVHandleError, r"request 0: .*stale")  # a's handle before the step
        a, b = step.handles
        eng.release(b)
        _refused(eng, [a, b], [1, 2], KVHandleError, r"request 1: .*not live")
        assert eng.decode([a], [9]).handles[0].num_tokens == 5  # the refusals left it usable
        a = eng.parts.kv.handle(a.seq_id)
    finally:
        eng.release(a)
        other.release(foreign)
    assert eng.parts.kv.stored_tokens() == 0


def test_a_request_at_the_models_context_is_refused(engines):
    eng = engines["replicated"]
    ctx = eng.max_context
    h = eng.prefill([Request(np.arange(ctx - 1) % 512)]).handles[0]
    try:
        h = eng.decode([h], [1]).handles[0]  # position ctx - 1: the last one
        assert h.num_tokens == ctx
        _refused(eng, [h], [1], BatchError, rf"decode: request 0 holds {ctx} tokens, the model's context of {ctx}")
    finally:
        eng.release(h)


def test_a_failure_inside_the_step_gives_the_token_back(engines, monkeypatch):
    eng = engines["sharded"]
    h = eng.prefill([Request([1, 2, 3, 4, 5])]).handles[0]
    snap = eng.parts.kv.snapshot()

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(eng.parts.model, "logits", boom)
    with pytest.raises(RuntimeError, match="injected"):
        eng.decode([h], [3])
    assert eng.parts.kv.snapshot() == snap
    monkeypatch.undo()
    eng.release(eng.decode([h], [3]).handles[0])
