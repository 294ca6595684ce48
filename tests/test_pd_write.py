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
