"""The trace backend replays any program faithfully: random programs over the op
kinds the model and attention use (and the traps of an op log: may-alias ops
that copy, views, in-place writes through views, out= forms, collectives) replay
bitwise equal to an eager re-run on fresh inputs, in every float dtype, with and
without inference mode. A recorder that trusts op schemas for aliasing fails it."""

from __future__ import annotations

import pytest
import torch
from trace_programs import KINDS, check, make_program

import graphcp.runtime.capture.graphs as graphs
from graphcp.dist import launch
from graphcp.runtime.capture.graphs import TraceBackend

PROGRAMS = 240  # split over the two modes below; CI runs all of them in a few seconds


@pytest.mark.parametrize("inference", [True, False], ids=["inference_mode", "no_grad"])
def test_random_programs_replay_bitwise(inference):
    seeds = range(PROGRAMS // 2) if inference else range(PROGRAMS // 2, PROGRAMS)
    failures = [f for s in seeds if (f := check(make_program(s), TraceBackend(), inference=inference))]
    assert not failures, failures[:5]


def test_programs_cover_every_kind_and_dtype():
    progs = [make_program(s) for s in range(PROGRAMS)]
    kinds = {i.kind for p in progs for i in p.instrs}
    assert kinds == set(KINDS)
    assert {d for p in progs for d in p.input_dtypes} == {torch.float32, torch.bfloat16, torch.float16}


def _schema_rule(func, inputs, outs) -> bool:
    """The old rule: skip whatever the schema says may alias (the bf16 replay bug)."""
    if func in graphs.UNINITIALISED:
        return True
    schema = getattr(func, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def test_the_schema_rule_mutant_fails_the_property(monkeypatch):
    monkeypatch.setattr(graphs, "replays_as_nothing", _schema_rule)
    failures = []
    for s in range(PROGRAMS // 2):  # until 10 have caught it (118 of the 120 do; each check costs ~0.1 s)
        if check(make_program(s), TraceBackend(), inference=True):
            failures.append(s)
            if len(failures) == 10:
                break
    assert len(failures) >= 10, f"only {len(failures)} of {PROGRAMS // 2} programs caught the schema rule"


def _collective_job(group, seeds):
    return [check(make_program(s, collectives=True), TraceBackend(), group) for s in seeds]


def test_random_programs_with_collectives_replay_bitwise_at_cp2():
    for rank, failures in enumerate(launch(_collective_job, 2, range(1000, 1040))):
        assert not [f for f in failures if f], (rank, [f for f in failures if f][:3])
