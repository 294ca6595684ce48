"""MooncakeEngine.write against a fake transfer engine that keeps Mooncake's
semantics: ``transfer_check_status`` reports a batch's first task only (and frees the
batch when that one is done). A write must return only once every byte has landed,
fail or time out with the documented errors, and never leave a run in flight."""

from __future__ import annotations

import pytest

from graphcp.pd.errors import TransferFailed, TransferTimeout
from graphcp.pd.mooncake import MooncakeEngine, coalesce_runs


class FakeTE:
    """Task j of a batch completes after ``polls[j]`` status calls on that batch;
    ``fail`` / ``never``: destination addresses whose task fails / never finishes."""

    def __init__(self, polls=(1, 3), fail=(), never=(), refuse=()):
        self.polls, self.fail, self.never, self.refuse = polls, set(fail), set(never), set(refuse)
        self.batches: dict[int, list[list]] = {}  # id -> tasks [dst, polls left]
        self.landed: list[int] = []

    def batch_transfer_async_write(self, session, src, dst, lengths):
        if any(d in self.refuse for d in dst):
            return -1
        bid = len(self.batches) + 1
        self.batches[bid] = [[d, self.polls[j % len(self.polls)]] for j, d in enumerate(dst)]
        return bid

    def transfer_check_status(self, bid):
        tasks = self.batches[bid]
        for t in tasks:
            if t[0] not in self.never:
                t[1] -= 1
                if t[1] == 0 and t[0] not in self.fail:
                    self.landed.append(t[0])
        first = tasks[0]
        if first[0] in self.fail and first[1] <= 0:
            return -1
        return 1 if first[1] <= 0 and first[0] not in self.never else 0

    def in_flight(self):
        return [t[0] for ts in self.batches.values() for t in ts if t[1] > 0 and t[0] not in self.never]


def _engine(te):
    eng = MooncakeEngine.__new__(MooncakeEngine)  # no real transfer engine: the fake
    eng._te = te
    return eng


def test_a_write_returns_only_when_every_run_landed():
    te = FakeTE(polls=(1, 3))  # a first task that finishes before the second
    _engine(te).write("rx", [0, 1000, 5000], [0, 1000, 9000], [1000, 1000, 8], 5.0, "rank 0")
    assert sorted(te.landed) == [0, 9000] and te.in_flight() == []  # the first two runs were one


def test_failures_and_timeouts_name_the_write_and_leave_nothing_in_flight():
    te = FakeTE(polls=(1, 4), fail={9000})
    with pytest.raises(TransferFailed, match="rank 1: Mooncake write to rx failed"):
        _engine(te).write("rx", [0, 5000, 7000], [0, 9000, 20000], [8, 8, 8], 5.0, "rank 1")
    assert te.in_flight() == []
    with pytest.raises(TransferFailed, match="could not be submitted"):
        _engine(FakeTE(refuse={64})).write("rx", [0, 100], [0, 64], [8, 8], 5.0, "rank 0")
    with pytest.raises(TransferTimeout, match="did not finish within 0.05s"):
        _engine(FakeTE(never={64})).write("rx", [0, 100], [0, 64], [8, 8], 0.05, "rank 0")


def test_coalesce_runs():
    assert coalesce_runs([0, 10, 30], [100, 110, 200], [10, 20, 5]) == [(0, 100, 30), (30, 200, 5)]
    assert coalesce_runs([0, 10], [100, 200], [10, 0]) == [(0, 100, 10)]


@pytest.mark.parametrize("kv_nbytes", [96, 98, 3])  # aligned, a bfloat16 tail, odd: padded to 8 either way
def test_the_ids_and_logits_after_a_regions_kv(kv_nbytes):
    """graphcp.pd.riders: the token ids (int64) and float32 logits packed after the KV at an
    8-aligned offset read back bit for bit as views of the region; the KV bytes untouched;
    an ``open`` naming another token count, or no counts, is refused in one line."""
    import torch

    from graphcp.pd.export import KVFormatError
    from graphcp.pd.riders import Riders, as_ids

    ids, logits = torch.tensor([5, 2**40, -1, 7]), torch.randn(11) * 1e30
    r = Riders.of(ids, logits)
    assert r == Riders.from_dict(r.to_dict(), 4, "t") and r.nbytes == 4 * 8 + 11 * 4
    region = torch.full((r.region_bytes(kv_nbytes),), 0xAB, dtype=torch.uint8)
    at = Riders.offset(kv_nbytes)
    assert at % 8 == 0 and kv_nbytes <= at < kv_nbytes + 8
    region[at:at + r.nbytes] = r.pack(ids, logits)
    got_ids, got_logits = r.views(region, kv_nbytes)
    assert torch.equal(got_ids, ids) and torch.equal(got_logits, logits) and got_logits.dtype == torch.float32
    assert bool((region[:kv_nbytes] == 0xAB).all())
    assert Riders.from_dict(None, 4, "t").views(region, kv_nbytes) == (None, None)  # none sent
    assert Riders().region_bytes(kv_nbytes) == kv_nbytes
    assert torch.equal(as_ids([1, 2]), as_ids(torch.tensor([1, 2], dtype=torch.int32)))
    for bad in ({"token_ids": 3, "vocab": 11}, {"token_ids": -4}, {"vocab": "11"}, [4, 11]):
        with pytest.raises(KVFormatError, match="request 'x'"):
            Riders.from_dict(bad, 4, "request 'x'")
