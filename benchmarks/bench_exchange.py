"""Bytes a rank receives per layer: the replicated cache's all-gather against the
sharded cache's pass-KV and pass-Q rings, measured from the collectives, next to
the analytic formulas; and the KV bytes a rank stores, replicated vs sharded.

Run: ``pytest benchmarks/bench_exchange.py --benchmark-only -s`` (prints the table).

Each case launches C local ranks (gloo) that hold one layer of a Llama-3-70B-like
shape (64 query heads, 8 KV heads, head_dim 128, bfloat16: 4 KiB of KV per token),
reserve a batch of T new tokens after P cached ones (the cached part prefilled as
an earlier chunk, so it is sharded too), and run the real exchange code once: the
all-gather of ``attention/kv_exchange.py`` and the rings of ``attention/ring/pass_kv.py``
and ``ring_pass_q.py`` (attention itself replaced by a kernel that writes zeros, so
only the communication runs). A counting :class:`CPGroup` records the bytes each
collective delivers to the rank; the table shows the largest rank's.

Analytic, per rank per layer (tokens of ``kv = 2 N_KV D e`` and ``q = N_H D e`` bytes):
all-gather ``(C - 1) cap kv`` (``cap``: the largest rank's rows); pass-KV
``(C - 1) / C (T + P) kv`` (the measured figure sends whole pages: up to a page per
request and rank more); pass-Q ``(C - 1) / C T q`` around the ring plus the
all-to-all of partial outputs and LSEs, ``(C - 1) T / C (q + 4 N_H)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from graphcp.attention.base import AttentionBackend
from graphcp.attention.kv_exchange import AllGather, KVForward
from graphcp.attention.ring.buffers import RingBuffers
from graphcp.attention.ring.exchange_choice import choose_exchange
from graphcp.attention.ring.hardware import HardwareSpec
from graphcp.attention.ring.pass_kv import run_pass_kv
from graphcp.attention.ring.pass_q import run_pass_q
from graphcp.attention.ring.plan import plan_sharded
from graphcp.cp import ZigzagLayout
from graphcp.dist import CPGroup, launch
from graphcp.kv.factory import make_cache
from graphcp.kv.spec import KVHeads, PoolSpec

HQ, HKV, D, PAGE, DTYPE = 64, 8, 128, 16, torch.bfloat16
E = 2  # bytes per element
CASES = [(c, t, p) for c in (2, 4, 8) for t, p in ((8192, 0), (1024, 0), (1024, 8192), (64, 4096))]


@dataclass
class CountingGroup(CPGroup):
    """A CPGroup that counts the bytes each collective delivers to this rank."""

    received: int = 0

    def all_gather_rows(self, x):
        out = super().all_gather_rows(x)
        self.received += out.nbytes - x.nbytes
        return out

    def send_recv(self, send, dst, recv, src):
        self.received += 0 if recv is None else recv.nbytes
        return super().send_recv(send, dst, recv, src)

    def all_to_all_rows(self, x, send_rows, recv_rows, out=None):
        out = super().all_to_all_rows(x, send_rows, recv_rows, out)
        self.received += out.nbytes
        return out


class ZeroAttention(AttentionBackend):
    """Writes output 0 and LSE 0 for the live rows: the rings' communication only."""

    name = "zero"

    def forward(self, q, kv_cache, meta, out, lse=None) -> None:
        n = meta.num_q_rows
        out[:n] = 0
        if lse is not None:
            lse[:n] = 0


def _measure(group: CPGroup, new: int, cached: int) -> dict:
    g = CountingGroup(group.rank, group.size, group.pg, group.timeout_s)
    C, r = g.size, g.rank
    pages = -(-(new + cached) // PAGE) + 4
    kv = make_cache("sharded", KVHeads(HKV, D), PoolSpec(range(1), pages, PAGE, DTYPE, rank=r, cp_size=C))
    prefix = kv.handle(kv.extend([None], [cached])[0]) if cached else None
    ids = kv.extend([prefix], [new])
    plan = ZigzagLayout(C).plan([new], [cached])
    out = {"stored": kv.stored_pages() * PAGE * 2 * HKV * D * E}
    q = torch.zeros(plan.max_local_rows, HQ, D, dtype=DTYPE)
    backend = ZeroAttention(None)
    for exchange, ring in (("pass-kv", run_pass_kv), ("pass-q", run_pass_q)):
        sh = plan_sharded(plan, kv, ids, r, exchange, torch.device("cpu"))
        g.received = 0
        ring(sh.ring, g, [backend] * C, kv.layer(0), RingBuffers("cpu"), q, torch.empty_like(q))
        out[exchange] = g.received
    # the replicated cache's all-gather of the largest rank's rows (the eager capacity)
    cap = plan.max_local_rows
    rep = make_cache("replicated", KVHeads(HKV, D), PoolSpec(range(1), 2, PAGE, DTYPE))
    fwd = KVForward(rep, AllGather(), g, None, None, torch.full((cap,), -1))
    fwd.gathered_slots = torch.full((C * cap,), -1)
    g.received = 0
    fwd.store(0, torch.zeros(cap, HKV, D, dtype=DTYPE), torch.zeros(cap, HKV, D, dtype=DTYPE))
    out["all-gather"] = g.received
    out["cap"] = cap
    return out


def _analytic(C: int, new: int, cached: int, cap: int) -> dict:
    kv, qb = 2 * HKV * D * E, HQ * D * E
    return {
        "all-gather": (C - 1) * cap * kv,
        "pass-kv": (C - 1) * (new + cached) * kv / C,
        "pass-q": (C - 1) * new * qb / C + (C - 1) * new * (qb + 4 * HQ) / C,
        "stored": (new + cached) * kv,  # replicated: every rank
    }


ROWS: list[str] = []


@pytest.mark.parametrize("cp,new,cached", CASES)
def test_bytes_received_per_layer(benchmark, cp, new, cached):
    results = benchmark.pedantic(launch, args=(_measure, cp, new, cached), rounds=1, iterations=1)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    want = _analytic(cp, new, cached, worst["cap"])
    assert worst["all-gather"] == want["all-gather"]
    # whole pages: at most a page of each of the C ranks' pieces of each of the two chunks more
    assert want["pass-kv"] - 1 <= worst["pass-kv"] <= want["pass-kv"] + 2 * cp * PAGE * 2 * HKV * D * E
    assert abs(worst["pass-q"] - want["pass-q"]) <= 2 * (cp - 1) * HQ * (2 * D * E + 4)  # uneven blocks: a row or two
    choice = choose_exchange("auto", new, cached, HQ, HKV, D, cp, E, HardwareSpec())
    mib = 2.0**20
    benchmark.extra_info.update({k: worst[k] for k in ("all-gather", "pass-kv", "pass-q", "stored")},
                                choice=choice.exchange)
    ROWS.append(
        f"| {cp} | {new} | {cached} | {worst['all-gather'] / mib:.2f} ({want['all-gather'] / mib:.2f}) | "
        f"{worst['pass-kv'] / mib:.2f} ({want['pass-kv'] / mib:.2f}) | {worst['pass-q'] / mib:.2f} "
        f"({want['pass-q'] / mib:.2f}) | {choice.exchange} | {want['stored'] / mib:.1f} / {worst['stored'] / mib:.1f} |"
    )
    if len(ROWS) == len(CASES):
        print("\n| C | T | P | all-gather MiB (analytic) | pass-KV MiB (analytic) | pass-Q MiB (analytic) | auto | "
              "KV stored MiB replicated / sharded |\n|---|---|---|---|---|---|---|---|")
        print("\n".join(ROWS))
    assert np.isfinite(worst["pass-q"])
