"""Micro-batched pipeline parallelism on the CPU: 2 stages (PP 2 x CP 1, gloo), one
batch prefilled as M = 1, 2, 4, 8 micro-batches.

Run: ``python -m pytest benchmarks/bench_pp.py --benchmark-only -q -s``.

The two stages run in two processes (one thread each). Unpipelined (M = 1) stage 1
idles while stage 0 runs and the other way round; with M equal micro-batches the
stages overlap and a P-stage pipeline ideally takes (M + P - 1) / (M P) of the
M = 1 time (0.75, 0.625, 0.5625 at P = 2). Every round starts at a barrier and
its time is the slowest rank's; the medians per M, the ratio to M = 1, the ideal,
stage 1's time waiting for its input (the bubble) and the cores the two ranks kept
busy (their CPU seconds per second: 2 when both stages ran at once, 1 when they
took turns) go to ``extra_info`` and are printed. The benchmark's own time is the whole launch (start-up included):
read the table. On a shared 2-core machine the two stages compete with other jobs
for the two cores; the ratios are what to compare.

The second benchmark isolates the schedule from the machine: the same two ranks run
``graphcp.runtime.pp.schedule.run_stage`` over real gloo point-to-point links, the hidden
rows of the same batch (4096 x 256 float32) handed on per micro-batch, but each
stage's compute is a sleep of ``STAGE_S / M`` (a device that computes while the host
waits, as a GPU does). It shows what the schedule and the transfers give when the
stages do not compete for cores: the ratio to M = 1 next to the ideal.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from graphcp import ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import barrier, gather_object, launch
from graphcp.runtime.pp.groups import pipeline_groups
from graphcp.runtime.pp.schedule import run_stage

MICROBATCHES = (1, 2, 4, 8)
LENS = [512] * 8  # 4096 tokens: one request a micro-batch at M = 8
ROUNDS = 5
STAGE_S = 0.4  # the schedule benchmark: one stage's compute for the whole batch
HIDDEN = 256


def _job(group):
    eng = PrefillEngine("default", RuntimeConfig(kv_tokens=8192), group, parallel=ParallelConfig(pp_size=2))
    rng = np.random.default_rng(0)
    batch = [Request(rng.integers(0, eng.cfg.vocab_size, n)) for n in LENS]
    res = {}
    for m in MICROBATCHES:
        times, waits, cores = [], [], []
        for r in range(ROUNDS + 1):  # the first round warms up
            barrier(group)
            t0, c0 = time.perf_counter(), time.process_time()
            out = eng.prefill(batch, microbatches=m)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            for h in out.handles:
                eng.release(h)
            if r:
                per_rank = gather_object(group, (dt, cpu, out.info.timings["wait_s"]))
                times.append(max(x[0] for x in per_rank))
                waits.append(per_rank[1][2])
                cores.append(sum(x[1] for x in per_rank) / times[-1])  # CPU seconds of both ranks per second
        res[m] = (float(np.median(times)), float(np.median(waits)), float(np.median(cores)), out.last_logits)
    return res


def test_pp_microbatch_speedup(benchmark):
    benchmark.group = "pp-microbatches"
    res = benchmark.pedantic(lambda: launch(_job, 2)[0], rounds=1, iterations=1)
    base, ref = res[1][0], res[1][3]
    print("\n| M | median s | vs M = 1 | ideal (M + 1) / 2M | stage 1 waiting s | cores busy |")
    for m in MICROBATCHES:
        t, wait, cores, last = res[m]
        ideal = (m + 1) / (2 * m)
        benchmark.extra_info[f"M{m}"] = {"median_s": round(t, 4), "ratio": round(t / base, 3), "ideal": ideal,
                                         "stage1_wait_s": round(wait, 4), "cores_busy": round(cores, 2)}
        print(f"| {m} | {t:.3f} | {t / base:.3f} | {ideal:.3f} | {wait:.3f} | {cores:.2f} |")
        # the same logits whatever the split (whole requests here)
        assert float((last - ref).norm() / ref.norm()) < 1e-5
    benchmark.extra_info.update(tokens=sum(LENS), requests=len(LENS), stages=2, threads_per_rank=1)
    assert torch.isfinite(ref).all()


def _schedule_job(group):
    pp = pipeline_groups(group, ParallelConfig(pp_size=2))
    res = {}
    for m in MICROBATCHES:
        rows = [sum(LENS) // m] * m

        def forward(k, hidden_in, n=rows[0], m=m):
            time.sleep(STAGE_S / m)  # the stage's compute, off the host's cores
            return torch.ones(n, HIDDEN) if hidden_in is None else hidden_in

        times = []
        for r in range(ROUNDS + 1):
            barrier(group)
            t0 = time.perf_counter()
            run_stage(rows, forward, lambda n: torch.empty(n, HIDDEN), pp.prev, pp.next)
            dt = time.perf_counter() - t0
            if r:
                times.append(max(gather_object(group, dt)))
        res[m] = float(np.median(times))
    return res


def test_pp_schedule_speedup_without_core_contention(benchmark):
    benchmark.group = "pp-microbatches"
    res = benchmark.pedantic(lambda: launch(_schedule_job, 2)[0], rounds=1, iterations=1)
    base = res[1]
    print(f"\n| M | median s (stage = {STAGE_S} s of sleep) | vs M = 1 | ideal (M + 1) / 2M |")
    for m in MICROBATCHES:
        ideal = (m + 1) / (2 * m)
        benchmark.extra_info[f"M{m}"] = {"median_s": round(res[m], 4), "ratio": round(res[m] / base, 3),
                                         "ideal": ideal}
        print(f"| {m} | {res[m]:.3f} | {res[m] / base:.3f} | {ideal:.3f} |")
    benchmark.extra_info.update(stage_s=STAGE_S, rows=sum(LENS), hidden=HIDDEN, stages=2)
