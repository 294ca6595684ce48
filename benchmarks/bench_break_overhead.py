"""Host time of one attention break on the graph path, per layer, compute taken out.

On the graph path a forward replays one captured segment and one break per layer,
so the host time of a break, times the layers (32-80 in real models), is host time
every forward pays. A break (``model.llama.attend``, as ``BreakableGraph.replay``
calls it) does graphcp's bookkeeping (its NVTX range, the layer's cache, the
context's metadata) and the backend's per-call work, then the kernel. Measured here,
on one rank's live batch (16 requests of 64 tokens at C = 8, rank 3, the replicated
cache), with tiny heads (1 query head, head_dim 8) so that compute is negligible:

- ``graphcp``: the break with a backend whose ``forward`` does nothing: graphcp's own
  per-break cost, whatever the backend;
- ``torch``: with the torch reference backend (on this CPU its "kernels" are ATen
  calls, a few per segment: dispatch, not FLOPs, at these sizes);
- ``triton``: only where it runs (a GPU, or the interpreter), skipped otherwise;
- ``prepare``: the backend's host planning, once per forward (not per layer);
- ``ring``: the token-sharded cache's break at C = 2 (two gloo processes), kernels
  taken out: the ring's bookkeeping and its exchange (loopback gloo, not NVLink).

extra_info carries the per-layer figure and breaks x layers for 32, 48, 64 and 80
layers. Run: ``python -m pytest benchmarks/bench_break_overhead.py --benchmark-only``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from host_stack import PAGE_SIZE, batch_of, host_stack

from graphcp.attention.base import AttentionBackend, AttentionSpec
from graphcp.attention.kv_exchange import AllGather, KVForward
from graphcp.attention.registry import AttentionLimits, available_backends, make_attention
from graphcp.attention.ring.attention import RingAttention
from graphcp.attention.ring.plan import plan_sharded
from graphcp.dist import CPGroup, barrier, launch
from graphcp.model.forward_context import ForwardContext
from graphcp.model.llama import attend

LAYERS = (32, 48, 64, 80)
HEADS, HEAD_DIM = 1, 8


class _NoKernel(AttentionBackend):
    """A backend that launches nothing: what is left of a break is graphcp's."""

    name = "none"

    def forward(self, q, kv_cache, meta, out, lse=None) -> None:
        return None


@pytest.fixture(scope="module")
def live_batch():
    """One rank's prepared live batch over a tiny-headed replicated cache, and its rows."""
    stack = host_stack(8, False, 16, 64, rank=3, layers=4, heads=HEADS, head_dim=HEAD_DIM)  # 4 layers of tiny heads
    prep = stack.preparer.prepare(batch_of(16, 64))
    rows = prep.ids.shape[0]
    q = torch.randn(rows, HEADS, HEAD_DIM)
    return stack, prep, q


def _backend(name: str):
    spec = AttentionSpec(HEADS, HEADS, HEAD_DIM, PAGE_SIZE, HEAD_DIM ** -0.5, "NHD")
    if name == "graphcp":
        return _NoKernel(spec)
    if name not in available_backends("cpu"):
        pytest.skip(f"the {name} backend does not run here")
    return make_attention(name, spec, "cpu",
                          AttentionLimits(max_segments=64, max_pages_per_segment=64, max_q_rows=4096))


@pytest.mark.parametrize("name", ["graphcp", "torch", "triton"])
def test_attention_break_host_time(benchmark, live_batch, name):
    stack, prep, q = live_batch
    backend = _backend(name)
    backend.prepare(prep.meta)
    kv = stack.preparer.kv
    ctx = ForwardContext(KVForward(kv, AllGather(), stack.preparer.group, backend, prep.meta,
                                   torch.from_numpy(prep.slots)))
    out = torch.empty_like(q)
    layers = iter(range(1 << 62))

    def one_break():
        attend(ctx, next(layers) % 4, q, out)  # the layers in turn, as a replay calls them

    benchmark.group = "attention break (one layer)"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host work: intra-op threads only add contention on a shared 2-core VM
    try:
        benchmark(one_break)
    finally:
        torch.set_num_threads(threads)
    _per_layer(benchmark)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_backend_prepare_per_forward(benchmark, live_batch, name):
    _, prep, _ = live_batch
    backend = _backend(name)
    benchmark.group = "attention prepare (one forward)"
    benchmark(backend.prepare, prep.meta)


def _ring_break_times(group: CPGroup, exchange: str, calls: int) -> list[float]:
    """One rank of a sharded cache at C = group.size: the ring break of one layer (the
    same 16 x 64-token batch, backends that launch nothing), ``calls`` times; seconds each."""
    stack = host_stack(group.size, True, 16, 64, rank=group.rank, heads=HEADS, head_dim=HEAD_DIM)
    prep = stack.preparer.prepare(batch_of(16, 64))
    kv = stack.preparer.kv
    spec = AttentionSpec(HEADS, HEADS, HEAD_DIM, PAGE_SIZE, HEAD_DIM ** -0.5, "NHD")
    ring = RingAttention(lambda: _NoKernel(spec), group, "cpu")
    plan = plan_sharded(prep.plan, kv, prep.seq_ids, group.rank, exchange, torch.device("cpu"))
    ring.prepare(plan.ring)
    q = torch.randn(prep.ids.shape[0], HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    times = []
    for _ in range(calls):
        barrier(group)  # both ranks enter together: the time is the ring's, not the other rank's lag
        t0 = time.perf_counter()
        ring.attend(plan.ring, _NoKernel(spec), kv.layer(0), q, out)
        times.append(time.perf_counter() - t0)
    return times


@pytest.mark.parametrize("exchange", ["pass-kv", "pass-q"])
def test_ring_break_host_time_cp2(benchmark, exchange):
    """The sharded cache's attention break at C = 2 (two gloo processes on this machine),
    kernels taken out: the ring's bookkeeping and its exchange over loopback gloo. Timed
    inside the ranks (pytest-benchmark times the launch once); rank 0's figures."""
    calls = 200
    times = benchmark.pedantic(lambda: launch(_ring_break_times, 2, exchange, calls)[0], rounds=1, iterations=1)
    t = np.array(times[calls // 10:]) * 1e6  # past the first calls (buffers grow once)
    benchmark.extra_info.update(
        per_layer_min_us=round(float(t.min()), 1), per_layer_median_us=round(float(np.median(t)), 1),
        **{f"x{n}_layers_median_us": round(float(np.median(t)) * n, 1) for n in LAYERS})


def _per_layer(benchmark) -> None:
    st = benchmark.stats.stats
    benchmark.extra_info.update(
        per_layer_min_us=round(st.min * 1e6, 2), per_layer_median_us=round(st.median * 1e6, 2),
        **{f"x{n}_layers_median_us": round(st.median * 1e6 * n, 1) for n in LAYERS})


def test_break_rows_are_live(live_batch):
    """The measured batch is a real one: this rank has live rows in every request."""
    _, prep, q = live_batch
    assert q.shape[0] == prep.plan.local_rows[3] > 0
    assert np.all(prep.meta.kv_lens_host > 0)
