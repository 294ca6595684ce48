"""Mixture-of-experts: MLP communication per rank per layer, ``ep`` vs ``tp``, and the
CPU time of the grouped expert compute against a per-expert Python loop.

Run: ``python -m pytest benchmarks/bench_moe.py --benchmark-only -q -s``
(``-s`` prints the tables; ``--benchmark-json out.json`` keeps them in ``extra_info``).

(a) ``test_mlp_bytes_per_layer``: one MoE layer (64 experts, hidden 1024, bfloat16)
    over a batch of T = 4096 tokens, T / C rows a rank, at C = 2, 4, 8 and top-k 2
    and 8, routed by a random router (near uniform). Each rank runs the ``tp`` block
    and the ``ep`` block on its rows; the bytes it sends and receives are measured
    from its collective calls (:class:`graphcp.profile.comm_bytes.CollectiveBytes`)
    and compared with the issue's formulas, per rank per layer:
    ``tp = 2 (C-1)/C T h b`` and ``ep = 2 k (C-1)/C (T/C) h b`` (uniform routing;
    plus the ``C x E`` counts all-gather). The figures the runtime reports
    (ForwardInfo.stats) must equal the measured ones.
(b) ``test_expert_compute``: top-8 of 64 experts, float32, 2048 rows (hidden 512,
    expert intermediate 256) and 256 rows (256, 128): the grouped form (sort by
    expert, one ``torch._grouped_mm`` per projection) against the reference loop over
    experts with masks (transformers' form).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphcp.dist import launch
from graphcp.model.moe.block import SparseMoeBlock
from graphcp.model.moe.experts import Experts, reference_moe, routed_experts
from graphcp.model.moe.router import SoftmaxTopKRouter
from graphcp.model.moe_config import MoeConfig
from graphcp.profile.comm_bytes import CollectiveBytes

TOKENS, EXPERTS, HIDDEN, INTER = 4096, 64, 1024, 64
DTYPE = torch.bfloat16


def _block(moe: MoeConfig, layout: str, group) -> SparseMoeBlock:
    """The same random weights on every rank (seeded), this rank's part of them."""
    torch.manual_seed(0)
    block = SparseMoeBlock(moe, HIDDEN, layout, group.rank, group.size, DTYPE)
    for p in block.parameters():
        p.copy_((torch.randn(p.shape) * p.shape[-1] ** -0.5).to(DTYPE))
    return block


def _rank_bytes(group, top_k: int) -> dict:
    moe = MoeConfig(num_experts=EXPERTS, top_k=top_k, intermediate_size=INTER, norm_topk_prob=True, layers=(0,))
    n = TOKENS // group.size
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(1 + group.rank)).to(DTYPE)
    out = {}
    with torch.inference_mode():
        for layout in ("tp", "ep"):
            block = _block(moe, layout, group)
            stats: dict = {}
            with CollectiveBytes(group.rank, group.size) as c:
                if layout == "tp":
                    block(x, group)
                else:
                    block.forward_ep(x, n, group, stats)
            reported = (stats.get("moe_bytes_sent"), stats.get("moe_bytes_received")) if layout == "ep" else \
                (block.static_bytes(n, HIDDEN * DTYPE.itemsize, group.size),) * 2
            out[layout] = {"sent": c.sent, "received": c.received, "reported": reported,
                           "imbalance": stats.get("moe_routing_imbalance")}
    return out


@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_mlp_bytes_per_layer(benchmark, cp, top_k):
    ranks = benchmark.pedantic(launch, args=(_rank_bytes, cp, top_k), rounds=1, iterations=1)
    b = DTYPE.itemsize
    formula = {"tp": 2 * (cp - 1) / cp * TOKENS * HIDDEN * b,
               "ep": 2 * top_k * (cp - 1) / cp * (TOKENS / cp) * HIDDEN * b + (cp - 1) * EXPERTS * 8}
    rows = {}
    for layout in ("tp", "ep"):
        sent = [r[layout]["sent"] for r in ranks]
        for r in ranks:  # the runtime's figures are what its collectives moved
            assert r[layout]["reported"] == (r[layout]["sent"], r[layout]["received"]), (layout, r[layout])
        rows[layout] = {"mean_MiB": np.mean(sent) / 2**20, "max_MiB": max(sent) / 2**20,
                        "formula_MiB": formula[layout] / 2**20, "mean_over_formula": np.mean(sent) / formula[layout]}
    rows["ep"]["imbalance_max"] = max(r["ep"]["imbalance"] for r in ranks)
    rows["ep_over_tp"] = rows["ep"]["mean_MiB"] / rows["tp"]["mean_MiB"]
    benchmark.extra_info.update(rows)
    print(f"\nC={cp} top-{top_k}: " + "; ".join(
        f"{k} {v['mean_MiB']:.2f} MiB (max {v['max_MiB']:.2f}, formula {v['formula_MiB']:.2f}, "
        f"x{v['mean_over_formula']:.3f})" for k, v in rows.items() if isinstance(v, dict))
        + f"; ep/tp {rows['ep_over_tp']:.2f}, routing imbalance {rows['ep']['imbalance_max']:.3f}")
    # tp is exact by construction; ep is the uniform-routing expectation of a random router
    assert abs(rows["tp"]["mean_over_formula"] - 1) < 1e-9
    assert abs(rows["ep"]["mean_over_formula"] - 1) < 0.1


#: (rows, experts, top-k, hidden, expert intermediate): a prefill chunk of a mid-size
#: MoE layer, and a small batch where the per-expert loop's host overhead dominates
SHAPES = {"2048x512": (2048, 64, 8, 512, 256), "256x256": (256, 64, 8, 256, 128)}


def _routed(shape: str):
    g = torch.Generator().manual_seed(0)
    n, E, k, H, I = SHAPES[shape]
    router = SoftmaxTopKRouter(E, k, H, True, torch.float32)
    experts = Experts(E, H, I, 0, torch.float32)
    with torch.no_grad():
        for p in (router.weight, experts.gate_up, experts.down):
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    x = torch.randn(n, H, generator=g)
    ids, w = router(x)
    return x, ids, w, experts


@pytest.mark.parametrize("form", ["grouped", "per-expert loop"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_expert_compute(benchmark, shape, form):
    x, ids, w, experts = _routed(shape)
    n, E, k, H, I = SHAPES[shape]
    benchmark.group = f"moe expert compute ({n} rows, top-{k} of {E}, {H} -> {I} -> {H}, float32)"
    with torch.inference_mode():
        if form == "grouped":
            out = benchmark(routed_experts, x, ids, w, experts)
        else:
            out = benchmark(reference_moe, x, ids, w, experts.gate_up, experts.down)
        assert torch.allclose(out, reference_moe(x, ids, w, experts.gate_up, experts.down), rtol=0, atol=1e-5)
