"""The mesh's bytes: what attention TP saves in KV, and what the layer communicators move.

Run: ``python -m pytest benchmarks/bench_mesh.py --benchmark-only -q -s``
(``-s`` prints the tables; ``--benchmark-json out.json`` keeps them in ``extra_info``).

(a) ``test_kv_bytes_per_layer``: the default model (8 heads, 2 KV heads, head_dim 64,
    float32) prefills 2048 new tokens at CP 2 with attention TP 1 (``--tp 2``, 2 ranks)
    and 2 (``--tp 4``, 4 ranks), replicated cache. Per rank per layer, from the stats:
    the KV bytes it stores (its pool's share of the batch) and receives (the all-gather
    over CP), next to the formula ``(C - 1) x capacity x 2 x (H_kv / A) x d x b``.
(b) ``test_communicator_bytes_per_layer``: one dense MLP layer (hidden 1024,
    intermediate 4096, bfloat16) over 4096 tokens, 4096 / C rows a rank, at (C, A) =
    (2, 1), (4, 1), (2, 2), (1, 4), and C = 2 with 2 DP replicas: the bytes a rank's
    collectives move (measured from the calls,
    :class:`graphcp.profile.comm_bytes.CollectiveBytes`) for the MLP's enter
    and leave and for o_proj's attention-TP all-reduce, next to
    :func:`graphcp.model.communicator.ffn_bytes` and ``attention_reduce_bytes``; and a
    MoE ``ep`` layer (16 experts, top-4) over the T ranks, against the stats it reports.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphcp import ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.attention.exchange import exchanged_bytes_per_layer
from graphcp.dist import launch
from graphcp.mesh import build_mesh
from graphcp.model.communicator import (
    LayerCommunicator,
    attention_reduce_bytes,
    ffn_bytes,
)
from graphcp.model.layers import ParallelMLP
from graphcp.model.moe.block import SparseMoeBlock
from graphcp.model.moe_config import MoeConfig
from graphcp.profile.comm_bytes import CollectiveBytes

KV_TOKENS = 2048
TOKENS, HIDDEN, INTER = 4096, 1024, 4096
DTYPE = torch.bfloat16


def _kv_job(group, tp: int):
    eng = PrefillEngine("default", RuntimeConfig(kv_tokens=4096), group, parallel=ParallelConfig(tp_size=tp, cp_size=2))
    rng = np.random.default_rng(0)
    out = eng.prefill([Request(rng.integers(0, 8192, n)) for n in (1024, 640, 384)])
    st = eng.stats()
    f = st["forwards"][-1]
    per_layer_stored = eng.parts.kv.stored_tokens() * eng.parts.kv.token_values(0) * eng.dtype.itemsize
    return {"received": f["bytes_received_per_layer"], "capacity": out.info.capacity, "kv_heads": st["kv_heads"],
            "stored": per_layer_stored}


@pytest.mark.parametrize("attn_tp", [1, 2])
def test_kv_bytes_per_layer(benchmark, attn_tp):
    r = benchmark.pedantic(launch, args=(_kv_job, 2 * attn_tp, 2 * attn_tp), rounds=1, iterations=1)[0]
    formula = exchanged_bytes_per_layer(r["capacity"], 2, 2 // attn_tp, 64, 4)
    assert r["received"] == formula
    row = {"received_MiB": r["received"] / 2**20, "formula_MiB": formula / 2**20, "stored_MiB": r["stored"] / 2**20,
           "kv_heads": r["kv_heads"]}
    benchmark.extra_info.update(row)
    print(f"\nattention TP {attn_tp} (CP 2): KV heads {r['kv_heads']}, a rank stores {row['stored_MiB']:.2f} MiB and "
          f"receives {row['received_MiB']:.2f} MiB a layer (formula {row['formula_MiB']:.2f})")


def _comm_job(world, cp: int, attn_tp: int, dp: int):
    mesh = build_mesh(world, ParallelConfig(tp_size=world.size, cp_size=cp, dp_size=dp))
    comm = LayerCommunicator(mesh.cp, mesh.attn_tp, mesh.ffn, mesh.dp)
    torch.manual_seed(0)
    mlp = ParallelMLP(HIDDEN, INTER, world.size, False, DTYPE)
    for p in mlp.parameters():
        p.copy_((torch.randn(p.shape) * p.shape[-1] ** -0.5).to(DTYPE))
    n = TOKENS // cp  # a CP partition's rows (the same on its attention-TP ranks)
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(1 + mesh.coords.cp)).to(DTYPE)
    moe = SparseMoeBlock(MoeConfig(num_experts=16, top_k=4, intermediate_size=64, norm_topk_prob=True, layers=(0,)),
                         HIDDEN, "ep", mesh.ffn.rank, mesh.ffn.size, DTYPE)
    for p in moe.parameters():
        p.copy_((torch.randn(p.shape) * p.shape[-1] ** -0.5).to(DTYPE))
    stats: dict = {}
    with torch.inference_mode():
        with CollectiveBytes(world.rank, world.size) as attn:
            comm.reduce_attention(x.clone())
        with CollectiveBytes(world.rank, world.size) as ffn:
            mlp(x, comm)
        with CollectiveBytes(world.rank, world.size) as ep:
            moe.forward_ep(x, n, comm, stats)
    return {"attn": (attn.sent, attn.received), "ffn": (ffn.sent, ffn.received), "rows": n,
            "ep": (ep.sent, ep.received), "ep_reported": (stats["moe_bytes_sent"], stats["moe_bytes_received"])}


@pytest.mark.parametrize("cp,attn_tp,dp", [(2, 1, 1), (4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2)])
def test_communicator_bytes_per_layer(benchmark, cp, attn_tp, dp):
    ranks = benchmark.pedantic(launch, args=(_comm_job, cp * attn_tp * dp, cp, attn_tp, dp), rounds=1, iterations=1)
    row_bytes = HIDDEN * DTYPE.itemsize
    n = ranks[0]["rows"]
    want = {"ffn": ffn_bytes(n, row_bytes, cp, attn_tp, dp), "attn": attention_reduce_bytes(n, row_bytes, attn_tp)}
    for r in ranks:
        for k in want:
            assert r[k] == (want[k], want[k]), (k, r[k], want[k])
        assert r["ep"] == r["ep_reported"], r  # the MoE ep stats are what its collectives moved
    row = {f"{k}_MiB": want[k] / 2**20 for k in want}
    row["ep_mean_MiB"] = float(np.mean([r["ep"][0] for r in ranks])) / 2**20
    benchmark.extra_info.update(row)
    print(f"\nC={cp} A={attn_tp} D={dp} (T={cp * attn_tp * dp}): MLP enter+leave {row['ffn_MiB']:.2f} MiB, "
          "o_proj all-reduce "
          f"{row['attn_MiB']:.2f} MiB each way a rank a layer (= formula); MoE ep (16 experts, top-4) "
          f"{row['ep_mean_MiB']:.2f} MiB (= its stats)")
