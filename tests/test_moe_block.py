"""The MoE pieces on one rank: the grouped expert compute against the per-expert
reference loop, the router and the whole block against transformers' own modules
(float32 and bfloat16, same rows in), the exchange plan against a simulated
all-to-all, the shared-expert hook, and the config and capture refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcp.dist import CPGroup
from graphcp.errors import ConfigError
from graphcp.model.config import ModelConfig
from graphcp.model.layers import ParallelMLP
from graphcp.model.moe.block import SparseMoeBlock
from graphcp.model.moe.ep import ExchangePlan
from graphcp.model.moe.experts import (
    GROUPED_MM_GRAPHS_VALIDATED,
    Experts,
    grouped_mm_capturable,
    grouped_mm_sync_free,
    reference_moe,
    routed_experts,
)
from graphcp.model.moe_config import MoeConfig

DTYPES = (torch.float32, torch.bfloat16)


def _experts(E: int, H: int, I: int, dtype, seed: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    ex = Experts(E, H, I, 0, dtype)
    with torch.no_grad():
        ex.gate_up.copy_(torch.randn(E, 2 * I, H, generator=g) * H ** -0.5)
        ex.down.copy_(torch.randn(E, H, I, generator=g) * I ** -0.5)
    return ex


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_experts_equal_the_per_expert_loop(dtype):
    """Sorted rows, one grouped matmul per expert, the weighted sum in ascending expert
    order == transformers' loop over experts with masks, bitwise; experts 5 and 6 get
    no rows, expert 0 every token."""
    g = torch.Generator().manual_seed(1)
    n, E, k, H, I = 37, 8, 3, 64, 48
    ex = _experts(E, H, I, dtype)
    x = torch.randn(n, H, generator=g).to(dtype)
    others = torch.tensor([1, 2, 3, 4, 7])
    picks = torch.stack([others[torch.randperm(5, generator=g)[: k - 1]].sort().values for _ in range(n)])
    ids = torch.cat([torch.zeros(n, 1, dtype=torch.long), picks], 1)  # ascending, as routers give them
    w = torch.rand(n, k, generator=g).to(dtype)
    got = routed_experts(x, ids, w, ex)
    want = reference_moe(x, ids, w, ex.gate_up, ex.down)
    assert got.dtype == dtype and torch.equal(got, want)
    empty = routed_experts(x[:0], ids[:0], w[:0], ex)  # a rank with no rows
    assert empty.shape == (0, H)


def _hf_block(family: str, dtype):
    import transformers
    from conftest import hf_config, randomise_

    cfg = hf_config(family, False)
    torch.manual_seed(3)
    if family == "qwen3_moe":
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    else:
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg)
    randomise_(block, 3)
    return cfg, block.to(dtype).eval()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_block_equals_transformers_block(family, dtype):
    """The same rows through transformers' sparse MoE block and ours (one rank, both
    layouts): the router's picks and weights, the experts and the weighted sum."""
    cfg, hf = _hf_block(family, dtype)
    moe = ModelConfig.from_hf_dict(cfg.to_dict()).moe
    x = torch.randn(1, 300, cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.inference_mode():
        want = hf(x)[0]
        _, hf_w, hf_ids = hf.gate(x[0])
        for layout in ("ep", "tp"):
            ours = SparseMoeBlock(moe, cfg.hidden_size, layout, 0, 1, dtype)
            ours.router.weight.copy_(hf.gate.weight)
            ours.experts.gate_up.copy_(hf.experts.gate_up_proj)
            ours.experts.down.copy_(hf.experts.down_proj)
            ids, w = ours.router(x[0])
            order = hf_ids.sort(dim=-1)
            assert torch.equal(ids, order.values)
            assert torch.equal(w, torch.gather(hf_w, -1, order.indices))
            got = ours(x[0], CPGroup()) if layout == "tp" else ours.forward_ep(x[0], x.shape[1], CPGroup())
            assert torch.equal(got, want), f"{layout}: {(got.float() - want.float()).abs().max()}"


def _simulate(counts: np.ndarray, El: int):
    """Every rank's pairs as (source, expert, index) labels, dispatched by the plans:
    what each rank computes, in the order it computes it."""
    C, E = counts.shape
    plans = [ExchangePlan.build(counts, r, El) for r in range(C)]
    sent = []
    for s in range(C):  # rank s's pairs sorted by expert, as sort_by_expert leaves them
        sent.append([(s, e, i) for e in range(E) for i in range(counts[s, e])])
    got = []
    for r in range(C):
        received = []
        for s in range(C):
            start = sum(plans[s].send_rows[:r])
            assert plans[s].send_rows[r] == plans[r].recv_rows[s]
            received += sent[s][start : start + plans[s].send_rows[r]]
        got.append([received[i] for i in plans[r].expert_major])
    return plans, got


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.data())
def test_exchange_plan_puts_each_pair_on_its_experts_rank_expert_major(C, El, data):
    E = C * El
    counts = np.array(data.draw(st.lists(st.lists(st.integers(0, 5), min_size=E, max_size=E), min_size=C,
                                         max_size=C)), dtype=np.int64).reshape(C, E)
    plans, got = _simulate(counts, El)
    for r, (plan, rows) in enumerate(zip(plans, got)):
        experts = [e for _, e, _ in rows]
        assert all(e // El == r for e in experts)  # only this rank's experts
        assert experts == sorted(experts)  # expert-major
        assert sorted(rows) == sorted((s, e, i) for s in range(C) for e in range(r * El, (r + 1) * El)
                                      for i in range(counts[s, e]))
        ends = np.cumsum([experts.count(e) for e in range(r * El, (r + 1) * El)])
        assert plan.local_ends.tolist() == ends.tolist()
        assert plan.per_rank.tolist() == [int(counts[:, q * El:(q + 1) * El].sum()) for q in range(C)]


def test_exchange_plan_imbalance_and_bytes():
    counts = np.array([[3, 1, 0, 0], [2, 2, 0, 0]])  # every pair to rank 0's experts (2 a rank)
    p0, p1 = ExchangePlan.build(counts, 0, 2), ExchangePlan.build(counts, 1, 2)
    assert p0.imbalance == 2.0 and p1.imbalance == 2.0  # max 8 / mean 4
    assert (p0.send_rows, p0.recv_rows, p1.send_rows, p1.recv_rows) == ([4, 0], [4, 4], [4, 0], [0, 0])
    # rank 1 dispatches its 4 rows (and gets them back), rank 0 receives them (and returns
    # them): 4 rows of 10 bytes each way, plus the counts all-gather (4 int64 each way)
    assert p1.bytes_each_way(1, 10, 4) == 4 * 10 + 32
    assert p0.bytes_each_way(0, 10, 4) == 4 * 10 + 32
    assert ExchangePlan.build(np.zeros((2, 4), np.int64), 0, 2).imbalance == 1.0


def test_shared_expert_is_added_to_the_routed_output():
    """The hook routers of other families use: a dense MLP on the rank's rows, added."""
    moe = MoeConfig(num_experts=4, top_k=2, intermediate_size=16, norm_topk_prob=True, layers=(0,),
                    shared_intermediate_size=32)
    torch.manual_seed(5)
    block = SparseMoeBlock(moe, 32, "tp", 0, 1, torch.float32)
    for p in block.parameters():
        p.copy_(torch.randn_like(p) * 0.2)
    x = torch.randn(11, 32)
    assert isinstance(block.shared, ParallelMLP)
    with torch.inference_mode():
        ids, w = block.router(x)
        want = reference_moe(x, ids, w, block.experts.gate_up, block.experts.down) + block.shared(x, CPGroup())
        assert torch.allclose(block(x, CPGroup()), want, rtol=0, atol=1e-6)
        assert torch.allclose(block.forward_ep(x, 11, CPGroup()), want, rtol=0, atol=1e-6)
        # padding rows past the live ones get the shared expert only
        assert torch.equal(block.forward_ep(x, 5, CPGroup())[5:], block.shared(x, CPGroup())[5:])


def test_grouped_mm_sync_free_where_torch_takes_its_cutlass_kernel():
    """torch's fast path takes the major version only (9 or 10): SM103 (10, 3) too."""
    assert grouped_mm_sync_free(torch.device("cpu"), torch.float32)
    cuda = torch.device("cuda")
    for cap in ((9, 0), (10, 0), (10, 3)):
        assert grouped_mm_sync_free(cuda, torch.bfloat16, cap), cap
    assert not grouped_mm_sync_free(cuda, torch.float32, (9, 0))
    assert not grouped_mm_sync_free(cuda, torch.bfloat16, (8, 0))
    assert not grouped_mm_sync_free(cuda, torch.bfloat16, (12, 0))


def test_grouped_mm_is_not_captured_on_cuda_until_validated_on_a_gpu():
    """pytorch issue 169970 (illegal access at replay, H100/H200): until the GPU check's
    MoE capture/replay has passed, the tp layout's experts stay out of CUDA graphs; the
    CPU trace backend replays them as always."""
    cuda = torch.device("cuda")
    assert not GROUPED_MM_GRAPHS_VALIDATED
    assert grouped_mm_capturable(torch.device("cpu"), torch.float32)
    assert not grouped_mm_capturable(cuda, torch.bfloat16, (9, 0))
    assert grouped_mm_capturable(cuda, torch.bfloat16, (9, 0), validated=True)
    assert grouped_mm_capturable(cuda, torch.bfloat16, (10, 3), validated=True)
    assert not grouped_mm_capturable(cuda, torch.float32, (9, 0), validated=True)


@pytest.mark.parametrize("key, value, message", [
    ("num_experts_per_tok", 9, r"num_experts_per_tok=9 exceeds the 8 experts"),
    ("num_experts_per_tok", 0, r"num_experts_per_tok must be >= 1"),
    ("mlp_only_layers", 1, r"mlp_only_layers must be a list of layer indices"),
    ("mlp_only_layers", [5], r"mlp_only_layers entry must be <= 1"),
    ("num_local_experts", 6, r"num_experts=8 and num_local_experts=6 disagree"),
    ("norm_topk_prob", "yes", r"norm_topk_prob must be true or false"),
    ("moe_intermediate_size", 0, r"moe_intermediate_size must be >= 1"),
])
def test_bad_moe_config_keys_are_named(key, value, message):
    from conftest import hf_config

    d = hf_config("qwen3_moe", False).to_dict()
    d.pop("num_local_experts", None)
    d["num_experts"] = 8
    d[key] = value
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(json.loads(json.dumps(d)), source="m/config.json")


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    from conftest import hf_config

    d = hf_config("qwen3_moe", False, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]).to_dict()
    assert ModelConfig.from_hf_dict(d).moe.layers == (1, 5)
    d = hf_config("mixtral", False, num_hidden_layers=3).to_dict()
    m = ModelConfig.from_hf_dict(d)
    assert m.moe.layers == (0, 1, 2) and not m.has_dense_mlp and m.moe.norm_topk_prob


def test_tp_moe_graphs_on_cuda_hold_the_experts_out_until_validated(monkeypatch):
    """The engine's capture check for moe='tp' on an H200: bfloat16 is sync-free, but a
    captured grouped matmul has not replayed on a GPU yet, so a full graph is refused and
    breakable graphs move the experts into the attention breaks; with the validation flag
    set both capture them."""
    from graphcp.model import moe as moe_pkg
    from graphcp.model.config import ModelConfig
    from graphcp.model.llama import DecoderModel
    from graphcp.model.presets import PRESETS

    cfg = ModelConfig.from_hf_dict(PRESETS["default-moe"])
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    model = DecoderModel(cfg, 1, torch.bfloat16, moe="tp")
    problem = model.capture_problem(cuda, full=True)
    assert problem is not None and "pytorch issue 169970" in problem and "graph='breakable'" in problem
    assert model.capture_problem(cuda, full=False) is None
    assert model.hold_experts_out_of_graphs(cuda)
    sparse = [layer for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse and all(layer.exchanges for layer in sparse)
    assert model.capture_problem(torch.device("cpu"), full=False) is None
    monkeypatch.setattr(moe_pkg.experts, "GROUPED_MM_GRAPHS_VALIDATED", True)
    fresh = DecoderModel(cfg, 1, torch.bfloat16, moe="tp")
    assert fresh.capture_problem(cuda, full=True) is None and not fresh.hold_experts_out_of_graphs(cuda)
    model32 = DecoderModel(cfg, 1, torch.float32, moe="tp")
    assert "sync-free kernel" in model32.capture_problem(cuda, full=False)
