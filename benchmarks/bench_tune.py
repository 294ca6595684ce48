"""Tuning speed: required rows + the exact DP over 100,000 synthetic batches (target < 5 s).

Run: ``pytest benchmarks/bench_tune.py --benchmark-only``. Generating the workload is
not timed (it stands in for reading a trace); what is timed is what ``graphcp tune``
adds on top: the vectorised per-batch required rows and the optimiser.
"""

from __future__ import annotations

import pytest

from graphcp.tune.optimise import CostModel, optimise
from graphcp.tune.required import required_rows
from graphcp.tune.workload import synthetic

N_BATCHES = 100_000

CASES = {
    # (spec, cp, layout, max_buckets, max_capacity)
    "longctx-cp4-zigzag-K8": ("longctx", 4, "zigzag", 8, 8192),
    "short-cp2-zigzag-K16": ("short", 2, "zigzag", 16, 8192),
    "chunked-cp2-interleave-K8": ("chunked", 2, "interleave", 8, 8192),
    # default worst case: V = 8192 / 8 = 1024 candidates, 32 buckets
    "longctx-cp1-zigzag-K32": ("longctx:budget=8192,load=0.5", 1, "zigzag", 32, 8192),
    # far past the defaults: 64k-row capacities at align 8, V ~ 8000 candidates
    "longctx64k-cp1-zigzag-K16": ("longctx:budget=65536,load=0.5", 1, "zigzag", 16, 65536),
}

_workloads: dict = {}


def _workload(spec: str):
    if spec not in _workloads:
        name, _, rest = spec.partition(":")
        _workloads[spec] = synthetic(f"{name}:batches={N_BATCHES}" + (f",{rest}" if rest else ""), seed=0)
    return _workloads[spec]


@pytest.mark.parametrize("case", list(CASES))
def test_tune_100k_batches(benchmark, case):
    spec, cp, layout, k, cap = CASES[case]
    w = _workload(spec)
    model = CostModel(2.0)

    def tune():
        req = required_rows(w, cp, layout)
        return optimise(req, k, 8, cap, model)

    res = benchmark.pedantic(tune, rounds=3, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(
        batches=w.n_batches, requests=w.n_requests, candidates=res.candidates, buckets=len(res.capacities), target_s=5.0
    )
    assert w.n_batches == N_BATCHES and len(res.capacities) == min(k, res.candidates)
