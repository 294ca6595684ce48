"""Decode over the CP-sharded cache (docs/decode.md): the merge's bytes, a step's time at
CP 1, 2 and 4, and the launches a step takes on the graph path.

Run: ``python -m pytest benchmarks/bench_decode.py --benchmark-only -s`` (prints the tables).

(a) ``test_merge_bytes_per_layer``: C local ranks (gloo) each hold a partial attention
    output of B decode rows over a Llama-3-70B-like layer (64 query heads of 128,
    bfloat16, a float32 LSE) and run the real merge (graphcp.attention.decode.merge) as
    an all-gather and as an all-to-all; a counting CPGroup records the bytes each
    collective delivers, which must equal the formula (``merge_bytes``), and the merged
    output must equal the merge of every rank's partials. The table shows which one
    ``auto`` takes.
(b) ``test_decode_step_time``: the default preset (a small Qwen3-style model) and the
    ``default-hybrid`` one (Qwen3.5-style: six Gated DeltaNet layers, each step advancing
    every request's states, and two full-attention ones) on the token-sharded cache, 8
    requests of 2048 cached tokens, at CP 1, 2 and 4 in the same run: the median time of a
    decode step eagerly and on the decode graphs (the trace stand-in on a CPU: it counts
    launches; the launch overhead it saves shows on a GPU), the launches of a graph step
    (segments and breaks), the bytes merged a layer.
(c) ``test_dsa_decode_step_time``: the same for a DSA model on the layer-split cache.
(d) ``test_eager_decode_vs_transformers``: an eager decode step of the default preset at
    CP 1 (float32) against transformers' own cached decode on the same checkpoint, at
    1 x 512, 8 x 1,024 and 32 x 256 (requests x cached tokens), in the same run, one
    torch thread: the paired ratio of their CPU times (benchmarks/vs_transformers.py) must
    be at most 1.2 (``GRAPHCP_BENCH_MAX_DECODE_RATIO``); the paired wall-time ratio is
    recorded beside it. On a shared 2-core machine two OpenMP threads spin while the other
    work runs, and wall times swing with the load, so neither measures the step.
(e) ``test_decode_host_time``: a decode step's host time (benchmarks/host_stack.py: the
    planner's preparation, the page bucket and the buffers' fill, the handles and the
    record after the replay) at 1, 8 and 64 requests of 2K and 32K cached tokens, in µs
    (median CPU time, one thread), against the prefill's whole host preparation of the
    same requests (``HostStack.prepare_fill_abort``) in the same run: at most 1.5x
    (``GRAPHCP_BENCH_MAX_HOST_RATIO``). The prefill of 2K-token requests is shown too.
(f) ``test_speculative_tokens_per_step``: speculative decoding's tokens a step with three
    EAGLE-3 drafts (docs/speculative.md, "Decoding").
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from host_stack import batch_of, decode_host_stack, host_stack
from vs_transformers import DecodeSteps, paired_ratio

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.attention.decode.merge import MERGE_FUNCTIONS, MERGES, choose_merge, merge_bytes
from graphcp.attention.ring.merge import merge_states
from graphcp.dist import CPGroup, launch
from graphcp.model.presets import ensure_preset

HQ, D, DTYPE = 64, 128, torch.bfloat16
MERGE_CASES = [(c, b) for c in (2, 4, 8) for b in (1, 8, 64)]


@dataclass
class CountingGroup(CPGroup):
    """A CPGroup that counts the bytes each collective delivers to this rank."""

    received: int = 0

    def all_gather_rows(self, x):
        out = super().all_gather_rows(x)
        self.received += out.nbytes - x.nbytes
        return out

    def all_to_all_rows(self, x, send_rows, recv_rows, out=None):
        out = super().all_to_all_rows(x, send_rows, recv_rows, out)
        self.received += out.nbytes - out.nbytes * recv_rows[self.rank] // max(1, sum(recv_rows))  # not its own
        return out


def _partials(C: int, B: int):
    g = torch.Generator().manual_seed(B)
    outs = torch.randn(C, B, HQ, D, generator=g).to(DTYPE)
    lses = torch.randn(C, B, HQ, generator=g) * 4
    lses[:, : B // 2, :3] = float("-inf")  # rows a rank holds no key of
    lses[0, : B // 2, :3] = 1.0
    return outs, lses


def _merge_job(group: CPGroup, B: int) -> dict:
    g = CountingGroup(group.rank, group.size, group.pg, group.timeout_s)
    outs, lses = _partials(g.size, B)
    want = merge_states(list(outs.unbind(0)), list(lses.unbind(0)))[0].to(DTYPE)
    res = {}
    for kind in MERGES:
        out = outs[g.rank].clone()
        g.received = 0
        returned = MERGE_FUNCTIONS[kind](g, out, lses[g.rank].clone())
        res[kind] = (g.received, returned, bool(torch.equal(out, want)))
    return res


ROWS: list[str] = []


@pytest.mark.parametrize("cp,rows", MERGE_CASES)
def test_merge_bytes_per_layer(benchmark, cp, rows):
    ranks = benchmark.pedantic(launch, args=(_merge_job, cp, rows), rounds=1, iterations=1)
    line = f"| {cp} | {rows} |"
    for kind in MERGES:
        want = merge_bytes(kind, rows, HQ, D, cp, DTYPE.itemsize)
        for measured, returned, exact in (r[kind] for r in ranks):
            assert measured == returned == want and exact, (kind, measured, returned, want)
        line += f" {want / 1024:.1f} |"
        benchmark.extra_info[kind] = want
    auto = choose_merge("auto", rows, HQ, D, cp, DTYPE.itemsize)
    ROWS.append(line + f" {auto} |")
    if len(ROWS) == len(MERGE_CASES):
        print("\n| C | B | all-gather KiB/layer | all-to-all KiB/layer | auto |\n|---|---|---|---|---|")
        print("\n".join(ROWS))


CONTEXT, REQUESTS, STEPS = 2048, 8, 8
STEP_MODELS = ("default", "default-hybrid")
STEP_ROWS: dict[str, list[str]] = {m: [] for m in STEP_MODELS}


def _step_job(group: CPGroup, model: str, kv_cache: str = "sharded", context: int = CONTEXT) -> dict:
    tokens = context * REQUESTS // (group.size if kv_cache == "sharded" else 1) + 2048
    rt = RuntimeConfig(kv_tokens=tokens, kv_cache=kv_cache, graph="breakable")
    engine = PrefillEngine(model, rt, group)
    rng = np.random.default_rng(0)
    out = engine.prefill([Request(rng.integers(0, 8192, context)) for _ in range(REQUESTS)], force_eager=True)
    handles, times = out.handles, {"eager": [], "graph": []}
    for i in range(2 * STEPS + 1):
        path = "eager" if i % 2 else "graph"
        t0 = time.perf_counter()
        step = engine.decode(handles, rng.integers(0, 8192, REQUESTS), force_eager=path == "eager")
        if i:  # (the first graph step captures its bucket)
            times[path].append(time.perf_counter() - t0)
        handles = step.handles
    last = next(s for s in reversed(engine.stats()["decode_steps"]) if s["path"] == "graph")
    return {"eager_ms": 1e3 * float(np.median(times["eager"])), "graph_ms": 1e3 * float(np.median(times["graph"])),
            "launches": last["launches"], "merged": last["bytes_merged_per_layer"], "merge": last["decode_merge"]}


@pytest.mark.parametrize("preset", STEP_MODELS)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_decode_step_time(benchmark, cp, preset):
    model = str(ensure_preset(preset))
    res = benchmark.pedantic(launch, args=(_step_job, cp, model), rounds=1, iterations=1)[0]
    assert res["launches"] == 1  # a dense model's step, a dense hybrid's (its linear steps inside): one segment
    assert (res["merged"] > 0) == (cp > 1)
    benchmark.extra_info.update(res)
    rows = STEP_ROWS[preset]
    rows.append(f"| {cp} | {res['eager_ms']:.1f} | {res['graph_ms']:.1f} | {res['launches']} | "
                f"{res['merge']} | {res['merged'] / 1024:.1f} |")
    if len(rows) == 3:
        print(f"\n{REQUESTS} requests x {CONTEXT} cached tokens, the {preset} preset, token-sharded cache (CPU):\n"
              "| C | eager ms/step | graph ms/step | launches/step | merge | merged KiB/layer |\n"
              "|---|---|---|---|---|---|")
        print("\n".join(rows))


DSA_CONTEXT = 1024
DSA_ROWS: list[str] = []


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_dsa_decode_step_time(benchmark, cp):
    """(c) The DSA preset (``default-dsa``: a small DeepSeek V3.2, index_topk 256, MoE
    ``ep``) on the layer-split cache (the memory answer for these models: docs/dsa.md), 8
    requests of 1024 cached tokens: a step's median time eagerly and on the decode graphs,
    the launches of a graph step (the MoE exchange stays a break), the bytes a rank
    receives a layer (each layer's owner broadcasts its output)."""
    model = str(ensure_preset("default-dsa"))
    res = benchmark.pedantic(launch, args=(_step_job, cp, model, "layer-split" if cp > 1 else "replicated",
                                           DSA_CONTEXT), rounds=1, iterations=1)[0]
    assert (res["merged"] > 0) == (cp > 1)
    benchmark.extra_info.update(res)
    DSA_ROWS.append(f"| {cp} | {res['eager_ms']:.1f} | {res['graph_ms']:.1f} | {res['launches']} | "
                    f"{res['merged'] / 1024:.1f} |")
    if len(DSA_ROWS) == 3:
        print(f"\n{REQUESTS} requests x {DSA_CONTEXT} cached tokens, default-dsa, layer-split cache (CPU):\n"
              "| C | eager ms/step | graph ms/step | launches/step | received KiB/layer |\n|---|---|---|---|---|")
        print("\n".join(DSA_ROWS))


DECODE_SHAPES = [(1, 512), (8, 1024), (32, 256)]
MAX_DECODE_RATIO = float(os.environ.get("GRAPHCP_BENCH_MAX_DECODE_RATIO", "1.2"))
DECODE_ROUNDS = 15


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("requests,context", DECODE_SHAPES, ids=[f"{b}x{n}" for b, n in DECODE_SHAPES])
def test_eager_decode_vs_transformers(benchmark, one_thread, requests, context):
    steps = DecodeSteps(str(ensure_preset("default")), requests, context)
    steps.graphcp(), steps.transformers()  # warm-up
    benchmark.group = f"decode-{requests}x{context}"
    benchmark.pedantic(steps.graphcp, rounds=DECODE_ROUNDS, iterations=1)
    cpu = paired_ratio(steps.graphcp, steps.transformers, DECODE_ROUNDS, time.process_time)
    wall = paired_ratio(steps.graphcp, steps.transformers, DECODE_ROUNDS)
    benchmark.extra_info.update(requests=requests, context=context, graphcp_over_transformers_cpu=round(cpu, 3),
                                graphcp_over_transformers_wall=round(wall, 3))
    print(f"\n{requests} x {context}: graphcp's eager decode step {cpu:.2f}x transformers' CPU time "
          f"({wall:.2f}x wall), paired")
    assert cpu <= MAX_DECODE_RATIO, (f"{requests} x {context}: graphcp's eager decode step takes {cpu:.2f}x "
                                     f"transformers' CPU time (target <= {MAX_DECODE_RATIO}x)")


HOST_CASES = [(b, n) for b in (1, 8, 64) for n in (2048, 32768)]
MAX_HOST_RATIO = float(os.environ.get("GRAPHCP_BENCH_MAX_HOST_RATIO", "1.5"))
HOST_ROWS: list[str] = []


def _median_cpu_us(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return 1e6 * float(np.median(times))


@pytest.mark.parametrize("requests,context", HOST_CASES, ids=[f"{b}x{n}" for b, n in HOST_CASES])
def test_decode_host_time(benchmark, one_thread, requests, context):
    stack = decode_host_stack(requests, context)
    tokens = np.arange(requests) % 1000
    benchmark.pedantic(stack.step, args=(tokens,), rounds=20, iterations=1)
    decode = _median_cpu_us(lambda: stack.step(tokens), 30)
    prefill = {}
    for n in {context, 2048}:
        pre, batch = host_stack(1, False, requests, n), batch_of(requests, n)
        prefill[n] = _median_cpu_us(lambda: pre.prepare_fill_abort(batch), 5 if n > 2048 else 15)
    ratio = decode / prefill[context]
    benchmark.extra_info.update(decode_us=round(decode, 1), prefill_us=round(prefill[context], 1),
                                prefill_2k_us=round(prefill[2048], 1), ratio=round(ratio, 3))
    HOST_ROWS.append(f"| {requests} | {context} | {decode:.0f} | {prefill[context]:.0f} | {ratio:.2f} | "
                     f"{prefill[2048]:.0f} | {decode / prefill[2048]:.2f} |")
    if len(HOST_ROWS) == len(HOST_CASES):
        print("\n| B | context | decode step host µs | prefill host prep µs | ratio | prefill of 2K µs | ratio |\n"
              "|---|---|---|---|---|---|---|")
        print("\n".join(HOST_ROWS))
    assert ratio <= MAX_HOST_RATIO, (f"{requests} x {context}: a decode step's host time {decode:.0f} µs is "
                                     f"{ratio:.2f}x the prefill's host preparation (target <= {MAX_HOST_RATIO}x)")


SPEC_DRAFTS = ("random", "partial", "agreeing")
SPEC_ROWS: list[str] = []


def _spec_models(root: Path) -> dict[str, tuple[str, str]]:
    """The tiny target and drafts of tests/test_speculative.py (tests/eagle3_ref.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from eagle3_ref import write_agreeing_draft, write_counting_target, write_draft, write_target

    counting = write_counting_target(root / "counting")
    return {"random": (str(write_target(root / "target")), str(write_draft(root / "draft"))),
            "partial": (str(counting), str(write_agreeing_draft(root / "partial", counting, swap=True))),
            "agreeing": (str(counting), str(write_agreeing_draft(root / "agreeing", counting)))}


def _spec_job(group: CPGroup, target: str, draft: str, k: int) -> dict:
    rt = RuntimeConfig(kv_tokens=4096, kv_cache="sharded", graph="breakable", draft=draft)
    engine = PrefillEngine(target, rt, group)
    prompts = [np.random.default_rng(j).integers(0, 512, 64).tolist() for j in range(REQUESTS)]
    engine.generate(prompts, 4, draft_tokens=k)  # (captures the buckets)
    t0 = time.perf_counter()
    plain = engine.generate(prompts, 32)
    t1 = time.perf_counter()
    spec = engine.generate(prompts, 32, draft_tokens=k)
    t2 = time.perf_counter()
    assert spec.tokens == plain.tokens
    return {**spec.speculative, "plain_ms": 1e3 * (t1 - t0), "spec_ms": 1e3 * (t2 - t1)}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("draft", SPEC_DRAFTS)
def test_speculative_tokens_per_step(benchmark, tmp_path_factory, draft, k):
    """(f) Speculative decoding at CP 2 on the token-sharded cache: 8 requests of 64 tokens,
    32 new tokens each, k draft tokens a step, with a random draft, one agreeing on half
    the tokens and one agreeing on all (the counting target of tests/test_speculative.py):
    tokens a request and step, the acceptance rate, the verify steps against plain
    decoding's, and the wall time of the whole generation either way (CPU, graphs on)."""
    target, dr = _spec_models(tmp_path_factory.getbasetemp() / "spec")[draft]
    res = benchmark.pedantic(launch, args=(_spec_job, 2, target, dr, k), rounds=1, iterations=1)[0]
    benchmark.extra_info.update(res)
    SPEC_ROWS.append(f"| {draft} | {k} | {res['acceptance_rate']:.2f} | {res['tokens_per_step']:.2f} | "
                     f"{res['steps']} | {res['plain_steps']} | {res['plain_ms']:.0f} | {res['spec_ms']:.0f} |")
    if len(SPEC_ROWS) == 2 * len(SPEC_DRAFTS):
        print(f"\n{REQUESTS} requests x 64 tokens, 32 new, CP 2, token-sharded cache (CPU):\n"
              "| draft | k | acceptance | tokens/step | verify steps | plain steps | plain ms | speculative ms |\n"
              "|---|---|---|---|---|---|---|---|")
        print("\n".join(SPEC_ROWS))
