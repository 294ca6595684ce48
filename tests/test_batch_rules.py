"""The batch's one table of rules (``graphcp/runtime/batch.py``: ``BATCH_RULES``, issue 37
item 5): the per-request path applies it rule by rule and names the culprit; the fast
path covers the same table and may only say "all pass" (the same result) or fall
through. A property test holds the two to that on random batches, good and bad in every
way the table names; then each rule's own refusal, the order the rules run in, the
call's ``draft_next`` rules and attention DP's use of the table's rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers import kv_cache
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from graphcp.cp import ZigzagLayout
from graphcp.dist import CPGroup
from graphcp.errors import BatchError
from graphcp.kv.handle import KVHandle
from graphcp.kv.paged import PagedKVCache
from graphcp.runtime.batch import (
    BATCH_RULES,
    BatchLimits,
    BatchPreparer,
    CheckedBatch,
    Request,
    _check_batch,
    check_draft_next,
    check_each,
)
from graphcp.runtime.dp import DataParallelPrefill, ReplicaHandle

VOCAB = 1000
CONTEXT = 200  # below the pool (256 tokens): the context rule bites first, unless a case raises it


class _SubRequest(Request):
    pass


def _cache() -> PagedKVCache:
    return kv_cache("replicated", 1, 65, 4, 1, 2)  # 64 usable pages of 4: 256 tokens


def _handles(kv: PagedKVCache) -> dict[str, Any]:
    """Prefixes of every kind the rules tell apart, the cache left holding the live ones."""
    ids = kv.extend([None, None, None], [10, 30, 150])
    stale = kv.handle(ids[0])
    kv.extend([stale], [2])
    released = kv.handle(kv.extend([None], [3])[0])
    kv.release(released)
    other = _cache()
    foreign = other.handle(other.extend([None], [10])[0])
    live = [kv.handle(s) for s in ids]
    return {"live0": live[0], "live1": live[1], "live2": live[2], "stale": stale, "released": released,
            "foreign": foreign, "forged": dataclasses.replace(live[1], cache_id=""), "int": 3, "list": [1, 2]}


def _outcome(fn: Callable[[], Any]) -> tuple[Any, BatchError | None]:
    try:
        return fn(), None
    except BatchError as e:
        return None, e


def _assert_same(got: CheckedBatch, want: CheckedBatch) -> None:
    """Every field the plan and the reservation take, and how they take it."""
    np.testing.assert_array_equal(got.flat, want.flat)
    assert got.flat.dtype == want.flat.dtype == np.int64
    np.testing.assert_array_equal(got.extend, want.extend)
    np.testing.assert_array_equal(got.prefix, want.prefix)
    assert got.extend.dtype == got.prefix.dtype == np.int64
    assert len(got.prefixes) == len(want.prefixes) and all(a is b for a, b in zip(got.prefixes, want.prefixes))
    assert (got.rows is None) == (want.rows is None)
    if got.rows is not None:
        np.testing.assert_array_equal(got.rows, want.rows)
    assert got.min_extend == want.min_extend == int(want.extend.min())
    assert not got.extend.flags.writeable and not got.prefix.flags.writeable


# ---- random batches ---------------------------------------------------------------------------
# Three kinds, drawn alike: clean (good forms, live prefixes: both paths accept, or the fast
# path falls through on an unusual form), one defect (a clean batch broken in exactly one
# way a rule names, or brought to a rule's boundary: what tells the paths apart), and wild
# (anything, in any number).
GOOD_DTYPES = [np.int16, np.int32, np.int64, np.uint16, np.uint32, np.uint64]  # hold every id < VOCAB
GOOD_TORCH = [torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64]
ODD_GOOD = [np.dtype(">i8"), np.dtype(">u4"), np.dtype(np.int64, metadata={"m": 1}), np.dtype(np.longlong)]
NARROW = [np.int8, np.uint8]  # wrap ids >= 128 or 256: refused or not, by the value
BAD_DTYPES = [np.bool_, np.float32, np.float64, object, np.complex64]
BAD_TORCH = [torch.bool, torch.float32, torch.float16, torch.int8, torch.uint8]
#: ids at and past the vocabulary's edges (VOCAB - 1 is good), as int64: a narrower dtype wraps them
EDGE_IDS = [-1, VOCAB, VOCAB, VOCAB - 1, 0, VOCAB + 5, -(1 << 40), (1 << 63) - 1]


def _ids(draw, n: int) -> np.ndarray:
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, VOCAB, n)


def _good_form(draw, ids: np.ndarray) -> Any:
    """``ids`` as a caller may pass them, every id kept."""
    form = draw(st.sampled_from(["array", "array", "list", "tensor", "tensor", "odd", "strided"]))
    if form == "array":
        return ids.astype(draw(st.sampled_from(GOOD_DTYPES)))
    if form == "list":
        return ids.tolist()
    if form == "tensor":
        return torch.from_numpy(ids).to(draw(st.sampled_from(GOOD_TORCH)))
    if form == "odd":  # the fast path falls through on these; the per-request path takes them
        return ids.astype(draw(st.sampled_from(ODD_GOOD)))
    return torch.from_numpy(np.repeat(ids, 2))[::2] if draw(st.booleans()) else np.repeat(ids, 2)[::2]


def _bad_tokens(draw, ids: np.ndarray) -> Any:
    """``ids`` broken in one way the token-array, non-empty or vocabulary rule names (or an
    id at the vocabulary's edge)."""
    n = ids.shape[0]
    kind = draw(st.sampled_from(["id", "id", "id", "uint64", "dtype", "torch", "narrow", "shape", "empty", "thing"]))
    if kind in ("id", "uint64"):
        ids = ids.copy()
        p = draw(st.integers(0, n - 1))
        if kind == "uint64":
            big = ids.astype(np.uint64)
            big[p] = draw(st.sampled_from([1 << 63, (1 << 64) - 1, VOCAB]))
            return big if draw(st.booleans()) else big.tolist()  # a list of ints past int64: a float array
        ids[p] = draw(st.sampled_from(EDGE_IDS))
        return ids.tolist() if draw(st.booleans()) else torch.from_numpy(ids) if draw(st.booleans()) else ids
    if kind == "dtype":
        return ids.astype(draw(st.sampled_from(BAD_DTYPES)))
    if kind == "torch":
        t = torch.from_numpy(ids).to(draw(st.sampled_from(BAD_TORCH)))
        return t.requires_grad_() if t.is_floating_point() and draw(st.booleans()) else t
    if kind == "narrow":
        return ids.astype(draw(st.sampled_from(NARROW)))
    if kind == "shape":
        return draw(st.sampled_from([ids.reshape(1, -1), ids.reshape(-1, 1), ids[:1].reshape(()), np.int64(3),
                                     torch.from_numpy(ids).reshape(1, -1), [ids.tolist(), ids.tolist()],
                                     [ids.tolist(), ids.tolist()[:1]], [[int(i)] for i in ids]]))
    if kind == "empty":
        return draw(st.sampled_from([[], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool),
                                     np.zeros(0, dtype=np.float32), torch.zeros(0, dtype=torch.int64), ()]))
    return draw(st.sampled_from(["abc", 7, None, ids.tolist() + ["x"], (i for i in ids), {1: 2}]))


def _length(draw, cached: int, limit: int) -> int:
    """New tokens that bring cached + new to the limit, or one past it."""
    return max(1, limit - cached + draw(st.sampled_from([0, 1])))


@st.composite
def _clean(draw, handles: dict[str, Any]) -> list:
    items, used = [], set()
    for _ in range(draw(st.integers(1, 6))):
        name = draw(st.sampled_from([None, None, None, "live0", "live1", "live2"]))
        prefix = None if name is None or name in used else handles[name]
        used.add(name)
        cls = draw(st.sampled_from([Request] * 6 + [_SubRequest]))  # a subclass: the fast path falls through
        items.append(cls(_good_form(draw, _ids(draw, draw(st.integers(1, 30)))), prefix))
    return items


@st.composite
def _one_defect(draw, handles: dict[str, Any], limit: int) -> tuple[list, int | None, str]:
    """A clean batch broken in one way (or brought to a boundary): its items, max_requests
    and container."""
    items = draw(_clean(handles))
    j = draw(st.integers(0, len(items) - 1))
    r = items[j]
    defect = draw(st.sampled_from(["tokens", "tokens", "tokens", "length", "prefix", "twice", "item", "max_requests",
                                   "container"]))
    max_requests, container = None, "list"
    if defect == "tokens":
        items[j] = Request(_bad_tokens(draw, _ids(draw, draw(st.integers(1, 30)))), r.prefix)
    elif defect == "length":
        cached = 0 if r.prefix is None else r.prefix.num_tokens
        items[j] = Request(_good_form(draw, _ids(draw, _length(draw, cached, limit))), r.prefix)
    elif defect == "prefix":
        bad = draw(st.sampled_from(["stale", "released", "foreign", "forged", "int", "list"]))
        items[j] = Request(r.tokens, handles[bad])
    elif defect == "twice":
        items.append(Request([1, 2], r.prefix if r.prefix is not None else handles["live1"]))
        if r.prefix is None:
            items.append(Request([3], handles["live1"]))
    elif defect == "item":
        items[j] = draw(st.sampled_from([[1, 2], None, {"tokens": [1]}, np.arange(3), r.tokens]))
    elif defect == "max_requests":
        max_requests = len(items) - draw(st.sampled_from([0, 1]))
    else:
        container = draw(st.sampled_from(["tuple", "sequence", "generator", "str", "empty", "request", "array"]))
    return items, max_requests, container


@st.composite
def _wild(draw, handles: dict[str, Any]) -> tuple[list, int | None, str]:
    items = []
    for _ in range(draw(st.integers(1, 6))):
        prefix = handles[draw(st.sampled_from(list(handles)))] if draw(st.integers(0, 2)) == 0 else None
        n = draw(st.one_of(st.integers(1, 40), st.integers(150, 260)))
        tokens = _bad_tokens(draw, _ids(draw, n)) if draw(st.booleans()) else _good_form(draw, _ids(draw, n))
        items.append(draw(st.sampled_from([Request] * 8 + [_SubRequest, lambda t, p: [1, 2]]))(tokens, prefix))
    return items, draw(st.one_of(st.none(), st.integers(1, 6))), "list"


class _Batch(list):
    """A sequence that is not a list (any Sequence is a batch)."""


CONTAINERS: dict[str, Callable[[list], Any]] = {
    "list": lambda items: items, "tuple": tuple, "sequence": _Batch, "generator": lambda items: (r for r in items),
    "str": lambda items: "abc", "empty": lambda items: [], "request": lambda items: items[0],
    "array": lambda items: np.asarray(items, dtype=object)}


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_the_fast_path_passes_exactly_what_the_rules_pass(data):
    """The fast path never refuses (it returns the checked batch or None), never accepts
    what the table refuses, and its result is the per-request path's; the preparer
    answers as the table does (the same error, word for word); nothing changes."""
    kv = _cache()
    handles = _handles(kv)
    max_context = data.draw(st.sampled_from([CONTEXT, 1000]), "max_context")  # 1000: the pool's 256 binds
    limit = min(max_context, kv.capacity_tokens)
    kind = data.draw(st.sampled_from(["clean", "one defect", "one defect", "wild"]), "kind")
    if kind == "clean":
        items, max_requests, container = data.draw(_clean(handles)), None, "list"
    elif kind == "one defect":
        items, max_requests, container = data.draw(_one_defect(handles, limit))
    else:
        items, max_requests, container = data.draw(_wild(handles))
    make = lambda: CONTAINERS[container](items)  # noqa: E731 - afresh for each path: a generator reads once
    prep = BatchPreparer(ZigzagLayout(2), kv, CPGroup(rank=0, size=2), VOCAB, max_context=max_context,
                         device=torch.device("cpu"), check_consistency=False, max_requests=max_requests)
    before = kv.snapshot()
    fast = _check_batch(make(), kv, VOCAB, limit, max_requests)
    slow, err = _outcome(lambda: check_each(make(), BatchLimits(kv, VOCAB, max_context, max_requests)))
    got, got_err = _outcome(lambda: prep._validate(make()))
    assert kv.snapshot() == before
    assert fast is None or isinstance(fast, CheckedBatch)
    if err is not None:
        event(f"{kind}: refused")
        assert fast is None, f"the fast path accepted a batch the rules refuse: {err}"
        assert type(got_err) is type(err) and str(got_err) == str(err)
        return
    event(f"{kind}: accepted " + ("by the fast path" if fast is not None else "after falling through"))
    assert got_err is None
    _assert_same(got, slow)
    if fast is not None:
        _assert_same(fast, slow)


def test_the_fast_path_takes_the_usual_batches():
    """What the per-forward path sees (native integer arrays, lists, CPU tensors, live
    prefixes; ids at the vocabulary's edges, a request at the context) is passed by the
    fast path, not the per-request one."""
    kv = _cache()
    h = _handles(kv)
    batch = [Request(np.arange(5)), Request([0, 2, VOCAB - 1], h["live0"]), Request(torch.arange(7, dtype=torch.int32)),
             Request(np.full(CONTEXT - 30, VOCAB - 1, dtype=np.uint16), h["live1"])]
    fast = _check_batch(batch, kv, VOCAB, CONTEXT, 4)
    assert fast is not None
    _assert_same(fast, check_each(batch, BatchLimits(kv, VOCAB, CONTEXT, 4)))


# ---- the table: each rule's own refusal, and the order they run in -----------------------------
def _one_rule_broken(rule: str, h: dict[str, Any]) -> tuple[Any, dict, str]:
    """A batch that breaks ``rule`` only, the limits to check it by, and the message."""
    ok = Request([1, 2])
    return {
        "container": ((r for r in [ok]), {}, r"^a batch must be a list of graphcp.Request, got generator$"),
        "max_requests": ([ok, ok, ok], {"max_requests": 2},
                         r"^batch has 3 requests; the attention backend was sized for RuntimeConfig.max_requests=2$"),
        "item type": ([ok, [1, 2]], {}, r"^batch item 1: expected a graphcp.Request, got list \(wrap token ids"),
        "token array": ([ok, Request([[1, 2], [3]])], {}, r"^request 1: tokens must be a 1-D sequence of integer ids"),
        "non-empty request": ([ok, Request([])], {}, r"^request 1 is empty: every request needs at least one new"),
        "prefix handle": ([Request([1], h["released"])], {}, r"^request 0: KV handle seq_id=\d+ is not live"),
        "prefix once": ([Request([1], h["live0"]), Request([2], h["live0"])], {},
                        r"^requests 0 and 1 both extend KV handle seq_id=\d+; a sequence can be extended once"),
        "context": ([ok, Request(np.ones(171, dtype=np.int64), h["live1"])], {},
                    r"^request 1: 30 cached \+ 171 new tokens exceed the model's context of 200$"),
        "pool": ([Request(np.ones(227, dtype=np.int64), h["live1"])], {"max_context": 1000},
                 r"^request 0: 257 tokens exceed the KV pool of 256; raise RuntimeConfig.kv_tokens$"),
        "vocabulary": ([ok, Request([4, 5, VOCAB])], {},
                       rf"^request 1, position 2: token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)$"),
    }[rule]


@pytest.mark.parametrize("rule", [r.name for r in BATCH_RULES])
def test_each_rule_refuses_what_it_names(rule):
    kv = _cache()
    batch, limits, message = _one_rule_broken(rule, _handles(kv))
    limits = BatchLimits(kv, VOCAB, **{"max_context": CONTEXT, **limits})
    before = kv.snapshot()
    with pytest.raises(BatchError, match=message):
        check_each(batch, limits)
    assert _check_batch(batch, kv, VOCAB, min(limits.max_context, kv.capacity_tokens), limits.max_requests) is None
    assert kv.snapshot() == before


def test_the_table_is_in_the_order_it_runs():
    """The batch's own rules, then each request's, then the ids': the order the
    per-request path applies them in, as before the table (the errors name the same
    request when a batch breaks several rules)."""
    scopes = [r.scope for r in BATCH_RULES]
    assert scopes == sorted(scopes, key=["batch", "request", "ids"].index)
    assert [r.name for r in BATCH_RULES] == ["container", "max_requests", "item type", "token array",
                                             "non-empty request", "prefix handle", "prefix once", "context", "pool",
                                             "vocabulary"]
    assert all(r.fast for r in BATCH_RULES)  # each says how the fast path covers it


def test_a_request_is_checked_whole_before_the_next():
    kv = _cache()
    h = _handles(kv)
    limits = BatchLimits(kv, VOCAB, CONTEXT)
    # request 0's stale handle before request 1's emptiness; request 1's length before request 0's bad id
    for batch, message in (([Request([1], h["stale"]), Request([])], r"^request 0: KV handle .* is stale"),
                           ([Request([VOCAB]), Request(np.ones(201, dtype=np.int64))], r"^request 1: 0 cached")):
        with pytest.raises(BatchError, match=message):
            check_each(batch, limits)


# ---- draft_next ------------------------------------------------------------------------------
def _draft(batch: Any, given: Any = None, microbatches: int = 1, drafting: bool = True,
           draft_tokens: dict[int, int] | None = None) -> np.ndarray | None:
    return check_draft_next(batch, given, microbatches, drafting=drafting, vocab_size=VOCAB,
                            draft_tokens=draft_tokens or {}, cache_id="here")


def test_draft_next_is_checked_against_the_call():
    assert _draft([Request([1])], drafting=False) is None
    with pytest.raises(BatchError, match=r"^prefill: draft_next needs an engine with a draft"):
        _draft([Request([1])], [3], drafting=False)
    with pytest.raises(BatchError, match=r"^prefill: microbatches=2 with a draft"):
        _draft([Request([1])], microbatches=2)
    for bad in ([1, 2], "ab", np.array([1]), 5):
        with pytest.raises(BatchError, match=r"^prefill: draft_next must list one token \(or None\) per request \(1\)"):
            _draft([Request([1])], bad)
    for bad in (VOCAB, -1, True, 1.0):
        with pytest.raises(BatchError, match=r"^prefill: draft_next\[1\] \(a token id\) must be"):
            _draft([Request([1]), Request([2])], [None, bad])
    assert _draft([Request([1]), Request([2])], [None, np.int64(7)]).tolist() == [-1, 7]
    assert _draft([Request([1]), Request([2])]).tolist() == [-1, -1]
    assert _draft((r for r in [Request([1])])).shape == (0,)  # not a batch: the container rule words it


def test_a_prefix_continues_from_its_last_draft_token():
    h = KVHandle(5, 3, (1,), cache_id="here")
    took = {5: 7}
    assert _draft([Request([7, 1], h)], draft_tokens=took).tolist() == [-1]
    for tokens in ([8, 7], np.array([8]), torch.tensor([8, 1], dtype=torch.int32)):
        with pytest.raises(BatchError, match=r"^request 1 extends a prefix whose last draft row took token 7, but its "
                                             r"first new token is 8"):
            _draft([Request([1]), Request(tokens, h)], draft_tokens=took)
    # another cache's handle, no draft token kept, or what the batch's rules refuse: left to the preparer
    other = dataclasses.replace(h, cache_id="there")
    for batch in ([Request([8], other)], [Request([8], KVHandle(6, 3, (1,), cache_id="here"))],
                  [Request("ab", h)], [Request([], h)], [Request([[8, 1]], h)], [[8]]):
        assert _draft(batch, draft_tokens=took).tolist() == [-1] * len(batch)


# ---- attention DP reads the batch by the same rules -------------------------------------------
def _dp() -> DataParallelPrefill:
    return DataParallelPrefill(replica=0, replicas=2, dp=None, stage=None, device=torch.device("cpu"), parts=None)


def test_dp_reads_the_batch_by_the_table_rules():
    dp = _dp()
    tokens, cached, fixed = dp._lengths([Request([1, 2]), Request(torch.tensor([3])),
                                         Request(np.arange(4, dtype=np.int32), ReplicaHandle(1, 9))])
    assert [t.tolist() for t in tokens] == [[1, 2], [3], [0, 1, 2, 3]]
    assert cached == [0, 0, 9] and fixed == [None, None, 1]
    for batch, message in (([Request([1]), [1, 2]], r"^batch item 1: expected a graphcp.Request, got list \(wrap"),
                           ([Request([[1, 2], [3]])], r"^request 0: tokens must be a 1-D sequence of integer ids"),
                           ([Request(np.ones((2, 2), dtype=np.int64))], r"^request 0: tokens must be a 1-D"),
                           ([Request([1], KVHandle(1, 1, (1,)))], r"^request 0: under attention DP a prefix is")):
        with pytest.raises(BatchError, match=message):
            dp._lengths(batch)
    for batch in ([], "ab", Request([1]), (r for r in [Request([1])])):  # before any replica is asked
        with pytest.raises(BatchError, match=r"^(empty batch|a batch must be a list of graphcp.Request, got)"):
            dp._requests(batch)

