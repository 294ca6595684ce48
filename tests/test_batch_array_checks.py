"""The batch's array checks (issue 30) against the request-by-request validation
they stand in for: on random batches, good and bad in every way a request can be,
whatever the array checks accept the per-request path accepts with the same result
(token ids, lengths, prefixes), and whatever it refuses they do not accept; so the
preparer's errors (worded by the per-request path, naming request and position)
are what they were."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import kv_cache

from graphcp.cp import ZigzagLayout
from graphcp.dist import CPGroup
from graphcp.errors import BatchError
from graphcp.runtime.batch import BatchPreparer, Request, _check_batch

VOCAB = 1000


class _SubRequest(Request):
    pass


def _preparer() -> BatchPreparer:
    kv = kv_cache("replicated", 1, 65, 4, 1, 2)  # 256 tokens of pool
    return BatchPreparer(ZigzagLayout(2), kv, CPGroup(rank=0, size=2), VOCAB, max_context=200,
                         device=torch.device("cpu"), check_consistency=False)


def _tokens(rng: random.Random, n: int):
    """Token ids of n tokens in one of the forms a caller may pass, sometimes bad."""
    ids = [rng.randrange(VOCAB) for _ in range(n)]
    bad = rng.random() < 0.25
    if bad and n:
        p = rng.randrange(n)
        ids[p] = rng.choice([-1, VOCAB, VOCAB + 5, -(1 << 40)])
    form = rng.randrange(10)
    if form == 0:
        return ids  # a list
    if form == 1:
        small = all(-(1 << 31) <= i < (1 << 31) for i in ids)
        return torch.tensor(ids, dtype=rng.choice([torch.int64, torch.int32]) if small else torch.int64)
    if form == 2:
        return np.asarray(ids, dtype=np.int32) if not bad else np.asarray(ids)
    if form == 3:  # unsigned: a "negative" id wraps to a huge one
        return np.asarray([i % (1 << 64) for i in ids], dtype=np.uint64)
    if form == 4 and rng.random() < 0.3:  # the wrong kind of thing
        return rng.choice([np.asarray(ids, dtype=np.float32), np.asarray(ids, dtype=bool), [ids, ids],
                           torch.tensor(ids, dtype=torch.float32), torch.tensor(ids).bool(), "abc", 7,
                           np.asarray(ids, dtype=object), np.asarray(ids).reshape(1, -1),
                           np.asarray(ids, dtype=">i8"), np.asarray(ids, dtype=np.dtype(np.int64, metadata={"m": 1}))])
    return np.asarray(ids, dtype=np.int64)


def _batch(rng: random.Random, prep: BatchPreparer, live: list):
    batch = []
    for _ in range(rng.randint(1, 6)):
        n = rng.choice([0, 1, 5, rng.randint(1, 60), rng.randint(150, 260)]) if rng.random() < 0.2 else \
            rng.randint(1, 40)
        prefix = rng.choice(live) if live and rng.random() < 0.3 else None
        kind = rng.random()
        if kind < 0.03:
            batch.append(rng.choice([list(range(3)), None, 5]))  # not a Request
        elif kind < 0.06:
            batch.append(_SubRequest(_tokens(rng, n), prefix))
        else:
            batch.append(Request(_tokens(rng, n), prefix))
    return batch


def _result(fn):
    try:
        return fn(), None
    except BatchError as e:
        return None, e


@pytest.mark.parametrize("seed", range(4))
def test_array_checks_accept_exactly_what_the_per_request_path_accepts(seed):
    rng = random.Random(seed)
    prep = _preparer()
    kv = prep.kv
    ids = kv.extend([None, None, None], [10, 30, 150])
    live = [kv.handle(s) for s in ids]
    stale = kv.handle(ids[0])
    kv.extend([live[0]], [2])
    live[0] = kv.handle(ids[0])
    released = kv.handle(kv.extend([None], [3])[0])
    kv.release(released)
    live += [stale, released]  # bad handles, sometimes
    accepted = refused = 0
    for _ in range(400):
        batch = _batch(rng, prep, live)
        if rng.random() < 0.05 and any(isinstance(r, Request) and r.prefix is not None for r in batch):
            first = next(r for r in batch if isinstance(r, Request) and r.prefix is not None)
            batch.append(Request([1, 2], first.prefix))  # the same handle twice
        before = kv.snapshot()
        fast = _check_batch(batch, kv, VOCAB, min(prep.max_context, kv.capacity_tokens))
        slow, err = _result(lambda: prep._validate_each(batch))
        got, got_err = _result(lambda: prep._validate(batch))
        assert kv.snapshot() == before
        if err is not None:
            refused += 1
            assert fast is None  # never accepts a batch the per-request path refuses
            assert type(got_err) is type(err) and str(got_err) == str(err)
            continue
        accepted += fast is not None
        for c in ([fast] if fast is not None else []) + [got]:
            np.testing.assert_array_equal(c.flat, slow.flat)
            assert c.flat.dtype == np.int64
            np.testing.assert_array_equal(c.extend, slow.extend)
            np.testing.assert_array_equal(c.prefix, slow.prefix)
            assert all(a is b for a, b in zip(c.prefixes, slow.prefixes))
            # what the plan and the reservation take from it: the rows, the least extend, read-only lengths
            assert (c.rows is None) == (slow.rows is None)
            if c.rows is not None:
                np.testing.assert_array_equal(c.rows, slow.rows)
            assert c.min_extend == int(slow.extend.min())
            assert not c.extend.flags.writeable and not c.prefix.flags.writeable
    assert accepted > 50 and refused > 50  # both sides exercised


def test_a_bad_id_is_named_by_request_and_position_whatever_the_form():
    prep = _preparer()
    for tokens in ([1, 2, VOCAB], np.array([1, 2, VOCAB]), torch.tensor([1, 2, VOCAB]),
                   np.array([1, 2, (1 << 64) - 1], dtype=np.uint64), np.array([1, 2, -3], dtype=np.int8)):
        with pytest.raises(BatchError, match=r"request 1, position 2: token id"):
            prep._validate([Request([4, 5]), Request(tokens)])


def test_array_checks_of_many_requests_agree_with_the_per_request_path():
    """Batches of more requests than the small-batch branch takes (its lengths through
    numpy): good ones agree with the per-request path, and bad ones (an empty request, a
    0-d token array, an id past the vocabulary, one request too long) are refused by
    both, the error naming the same request."""
    prep = _preparer()
    rng = np.random.default_rng(30)
    for bad in (None, "empty", "scalar", "id", "long"):
        batch = [Request(rng.integers(0, VOCAB, int(n))) for n in rng.integers(1, 3, 100)]
        j = int(rng.integers(0, 100))
        if bad == "empty":
            batch[j] = Request(np.zeros(0, dtype=np.int64))
        elif bad == "scalar":
            batch[j] = Request(np.int64(3))
        elif bad == "id":
            batch[j] = Request(np.array([1, VOCAB]))
        elif bad == "long":
            batch[j] = Request(np.ones(201, dtype=np.int64))
        fast = _check_batch(batch, prep.kv, VOCAB, min(prep.max_context, prep.kv.capacity_tokens))
        slow, err = _result(lambda: prep._validate_each(batch))
        if bad is None:
            assert err is None and fast is not None
            np.testing.assert_array_equal(fast.flat, slow.flat)
            np.testing.assert_array_equal(fast.extend, slow.extend)
            assert fast.min_extend == slow.min_extend == int(slow.extend.min())
        else:
            assert fast is None and err is not None and f"request {j}" in str(err)
