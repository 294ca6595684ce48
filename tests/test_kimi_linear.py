"""Kimi Linear (docs/kimi_linear.md) against transformers' ``KimiLinearForCausalLM``, on
tests/conftest.py's KIMI_TINY (two KDA layers, an MLA layer with no RoPE, a KDA layer;
layer 0 dense, DeepSeek's MoE after it):

- KDA's math equals transformers' torch fallbacks: the chunked rule (within 1e-6), the
  one-token recurrent step a decode step runs (``recurrent_kimi_delta_attention``), the
  forget gate's per-channel log decays and the gated RMSNorm;
- the hybrid family's scan with per-channel decays: the maps of each rank's blocks,
  composed in block order, give every block's incoming state as a sequential run reaches
  it (C = 4, requests shorter than 2C, a cached state);
- the engine at CP 1, 2 and 4, graphs off and breakable, ``--moe ep`` and ``tp``, the
  replicated and layer-split caches: requests of 1 to 600 tokens in one batch, every
  token's logits within 1e-4 (float32) of transformers', and a request prefilled in three
  pieces (a 2-token prefix, shorter than the convolution's halo; a piece ending inside a
  zigzag block; the rest) equal to one shot; bfloat16 within 2e-2 on the all-experts twin
  (a router near-tie flips an expert under bfloat16 rounding, tests/test_moe_parity.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import rel_err
from test_hybrid import check_logits

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.cp import make_layout
from graphcp.dist import launch
from graphcp.model.hybrid.gdn import augmented_rule
from graphcp.model.hybrid.scan import LinearPlan, compose
from graphcp.model.hybrid.varlen import ChunkSlots, SlotPlan
from graphcp.model.kimi_linear.kda import (
    chunk_kda,
    conv_step,
    forget_gate,
    gated_norm,
    kda_conv,
    query_key,
    recurrent_kda,
    varlen_kda,
)
from graphcp.runtime.capture.buckets import BucketSet

LENS = [1, 7, 45, 600]
#: the long request's pieces: a prefix shorter than the convolution's halo (K - 1 = 3), then
#: one ending inside a zigzag block at CP 2 and 4, then the rest
CUTS = (2, 203)
BUCKETS = BucketSet((64, 256, 512), padding_factor=64.0)
#: the all-experts twin bfloat16 runs on: every expert of one group (no top-k to flip)
ALL_EXPERTS = dict(num_experts_per_tok=8, n_group=1)
#: CP size -> (dtype, graph, cache mode, moe) runs
RUNS = {
    2: [("float32", "off", "replicated", "ep"), ("float32", "breakable", "layer-split", "tp"),
        ("bfloat16", "off", "replicated", "tp"), ("bfloat16", "breakable", "layer-split", "ep")],
    4: [("float32", "breakable", "replicated", "ep")],
}


def _tokens():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 512, n) for n in LENS]


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return {"float32": hf_model_dir("kimi_linear"), "bfloat16": hf_model_dir("kimi_linear", **ALL_EXPERTS)}


@pytest.fixture(scope="module")
def reference(folders, hf_model):
    """transformers' logits of every request, in each dtype (bfloat16: the twin's)."""
    out = {}
    for dtype, folder in folders.items():
        model = hf_model(folder, dtype)
        with torch.no_grad():
            out[dtype] = [model(torch.tensor(t)[None]).logits[0].float() for t in _tokens()]
    return out


def _rows(g: torch.Generator, T: int, H: int, dk: int, dv: int):
    q, k = torch.randn(1, T, H, dk, generator=g), torch.randn(1, T, H, dk, generator=g)
    v = torch.randn(1, T, H, dv, generator=g)
    decay = -0.1 * torch.rand(1, T, H, dk, generator=g)  # per key channel
    return q, k, v, decay, torch.rand(1, T, H, generator=g)


def test_the_kda_math_is_transformers():
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        KimiLinearForgetGate,
        KimiLinearRMSNormGated,
        chunk_kimi_delta_attention,
        recurrent_kimi_delta_attention,
    )

    g = torch.Generator().manual_seed(0)
    T, H, dk, dv = 130, 2, 24, 16
    q, k, v, decay, beta = _rows(g, T, H, dk, dv)
    s0 = torch.randn(1, H, dk, dv, generator=g)
    # the chunked rule, its pair scores split across sub-chunks: transformers' sums within
    # float32 rounding, for mild and for strong decays (a factor of exp(-3000) underflows, none overflows)
    for strength in (1.0, 30.0):
        ref, ref_state = chunk_kimi_delta_attention(q, k, v, strength * decay, beta, initial_state=s0,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        qn, kn = query_key(q[0], k[0])
        rows = [x.transpose(0, 1)[None] for x in (qn, kn, v[0], strength * decay[0], beta[0])]
        pad = [torch.cat([x, x.new_zeros(*x.shape[:2], 192 - T, *x.shape[3:])], dim=2) for x in rows]
        out, state = chunk_kda(*pad, s0)
        torch.testing.assert_close(out[0, :, :T].transpose(0, 1), ref[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(state, ref_state, rtol=0, atol=1e-6)

    # the one-token step, eight steps from the chunked rule's state
    state, steps = ref_state, []
    want, want_state = recurrent_kimi_delta_attention(q[:, :8], k[:, :8], v[:, :8], decay[:, :8], beta[:, :8],
                                                      initial_state=ref_state, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    for t in range(8):
        qt, kt = query_key(q[:, t], k[:, t])
        o, state = recurrent_kda(qt, kt, v[:, t], decay[:, t], beta[:, t], state)
        steps.append(o)
    assert torch.equal(torch.stack(steps, dim=1), want) and torch.equal(state, want_state)

    # the forget gate and the gated norm
    cfg = KimiLinearConfig(hidden_size=32, linear_head_dim=dk, linear_num_heads=H)
    gate = KimiLinearForgetGate(cfg)
    with torch.no_grad():
        for p in gate.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        x = torch.randn(1, 5, 32, generator=g)
        got = forget_gate(gate.f_b_proj(gate.f_a_proj(x[0])), gate.dt_bias, gate.A_log, H)
        assert torch.equal(got, gate(x)[0])
        norm = KimiLinearRMSNormGated(dk, eps=1e-5)
        norm.weight.copy_(1 + 0.2 * torch.randn(dk, generator=g))
        core, z = torch.randn(5, H, dk, generator=g).bfloat16(), torch.randn(5, H, dk, generator=g).bfloat16()
        assert torch.equal(gated_norm(core, z, norm.weight, 1e-5), norm(core, z))


@pytest.mark.parametrize("dtype,weight_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                                ("bfloat16", "float32")])
def test_the_convolution_its_step_and_the_bounded_gate_are_transformers(dtype, weight_dtype):
    """The short convolution over a block after its halo and the one-token step a decode
    step runs (a float32 weight over bfloat16 rows: GLM-5-Next keeps its convolution so),
    and the forget gate with GLM-5-Next's ``linear_lower_bound``."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextForgetGate
    from transformers.models.kimi_linear.modeling_kimi_linear import causal_conv1d_fn, causal_conv1d_update

    g = torch.Generator().manual_seed(2)
    C, K, T = 12, 4, 9
    x = torch.randn(1, C, T, generator=g).to(getattr(torch, dtype))
    w = (torch.randn(C, K, generator=g) * K ** -0.5).to(getattr(torch, weight_dtype))
    want = causal_conv1d_fn(x, w, activation="silu")
    rows = x.transpose(1, 2)
    got = kda_conv(rows[:, 3:], rows[:, :3], w)  # a block after its 3-row halo
    # (float32: F.conv1d sums the taps in its own order; bfloat16 rounds to the same values)
    assert rel_err(got.float(), want.transpose(1, 2)[:, 3:].float()) <= 1e-6
    state = x[:, :, T - K:T - 1].clone()  # the conv state before the last token (oldest first)
    step = causal_conv1d_update(x[:, :, -1:], state, w, activation="silu")
    window = torch.cat([x[:, :, T - K:T - 1], x[:, :, -1:]], -1).transpose(1, 2)
    assert rel_err(conv_step(window, w).float(), step[:, :, 0].float()) <= 1e-6

    from transformers import Glm5NextTextConfig

    cfg = Glm5NextTextConfig(hidden_size=32, linear_head_dim=8, linear_num_heads=2, linear_lower_bound=-5.0)
    gate = Glm5NextTextForgetGate(cfg)
    with torch.no_grad():
        for p in gate.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        h = torch.randn(1, 5, 32, generator=g)
        got = forget_gate(gate.f_b_proj(gate.f_a_proj(h[0])), gate.dt_bias, gate.A_log, 2, lower_bound=-5.0)
        assert torch.equal(got, gate(h)[0])


def test_the_scan_composes_every_block_with_per_channel_decays():
    g = torch.Generator().manual_seed(1)
    T, H, dk, dv = 130, 2, 16, 8
    q, k, v, decay, beta = _rows(g, T, H, dk, dv)
    qn, kn = query_key(q[0], k[0])
    s0 = torch.randn(H, dk, dv, generator=g)
    C, lens = 4, [3, 11, T]
    plan = make_layout("zigzag", C).plan(lens, [0, 0, 20])
    prefix = torch.zeros(3, H, dk, dv)
    prefix[2] = s0
    rows_of = {name: torch.cat([t[:n] for n in lens]) for name, t in
               (("q", qn), ("k", kn), ("v", v[0]), ("g", decay[0]), ("b", beta[0]))}
    maps, plans = [], []
    for r in range(C):
        lp = LinearPlan.build(plan, r, np.array([-1, -1, 0]), np.array([1, 3, 5]), 4)
        local = torch.from_numpy(plan.rank(r).rows.copy())
        rows = [rows_of[n].index_select(0, local) for n in ("q", "k", "v", "g", "b")]
        known = torch.from_numpy(lp.block_index == 0)
        _, _, x, y = augmented_rule(*rows, prefix.index_select(0, torch.from_numpy(lp.block_request)), known,
                                    _varlen_rule(lp.cu))
        maps.append((x, y))
        plans.append(lp)
    incoming, final = compose(torch.cat([m[0] for m in maps]), torch.cat([m[1] for m in maps]),
                              torch.from_numpy(plans[0].compose), prefix)
    starts = np.cumsum([0] + lens)
    for j, n in enumerate(lens):
        ends = np.cumsum([0] + [(n + 2 * C - 1 - b) // (2 * C) for b in range(2 * C)])
        for b in range(2 * C + 1):  # each block's incoming state, then the final one
            sl = slice(starts[j], starts[j] + int(ends[b]))
            seq = [rows_of[n][sl].transpose(0, 1)[None] for n in ("q", "k", "v", "g", "b")]
            length = seq[0].shape[2]
            padded = -(-max(length, 1) // 64) * 64
            seq = [torch.cat([x, x.new_zeros(*x.shape[:2], padded - length, *x.shape[3:])], dim=2) for x in seq]
            _, want = chunk_kda(*seq, prefix[j:j + 1])
            got = incoming[j, b] if b < 2 * C else final[j]
            assert rel_err(got, want[0]) < 1e-5, (j, b)


def _varlen_rule(cu: np.ndarray):
    """The torch varlen KDA rule over blocks ``cu`` (q and k already normalised)."""
    sp = SlotPlan.build(cu, 64)
    slots = ChunkSlots(*(torch.from_numpy(a) for a in (sp.rows, sp.position, sp.order, sp.inverse)), sp.steps)
    return lambda q, k, v, g, b, s0: varlen_kda(q, k, v, g, b, s0, slots)


def test_the_varlen_rule_equals_the_padded_blocks():
    """Blocks of 0 to 200 rows as one varlen batch: every output and final state equal to
    the padded blocks' (chunk_kda, transformers' form)."""
    g = torch.Generator().manual_seed(3)
    lens, H, d = [0, 1, 63, 64, 65, 200], 2, 8
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    n = int(cu[-1])
    q, k = query_key(torch.randn(n, H, d, generator=g), torch.randn(n, H, d, generator=g))
    v, decay = torch.randn(n, H, d, generator=g), -0.1 * torch.rand(n, H, d, generator=g)
    beta, s0 = torch.rand(n, H, generator=g), torch.randn(len(lens), H, d, d, generator=g)
    out, final = _varlen_rule(cu)(q, k, v, decay, beta, s0)
    for b, length in enumerate(lens):
        sl = slice(int(cu[b]), int(cu[b + 1]))
        padded = -(-max(length, 1) // 64) * 64
        seq = [x[sl].transpose(0, 1)[None] for x in (q, k, v, decay, beta)]
        seq = [torch.cat([x, x.new_zeros(*x.shape[:2], padded - length, *x.shape[3:])], dim=2) for x in seq]
        want, want_final = chunk_kda(*seq, s0[b:b + 1])
        assert torch.equal(out[sl], want[0, :, :length].transpose(0, 1)) and torch.equal(final[b], want_final[0]), b


def _run(eng: PrefillEngine) -> tuple[list, torch.Tensor, set]:
    """The batch in one forward, then the long request in three pieces (CUTS) beside a
    short one; every token's logits, and the paths the forwards took."""
    toks = _tokens()
    one = eng.prefill([Request(t) for t in toks], all_logits=True)
    for h in one.handles:
        eng.release(h)
    long, (a, b) = toks[3], CUTS
    head = eng.prefill([Request(long[:a])], all_logits=True)
    mid = eng.prefill([Request(long[a:b], head.handles[0]), Request(toks[1])], all_logits=True)
    tail = eng.prefill([Request(long[b:], mid.handles[0])], all_logits=True)
    for h in (*mid.handles[1:], *tail.handles):
        eng.release(h)
    paths = {one.info.path, head.info.path, mid.info.path, tail.info.path}
    return [x.clone() for x in one.logits], torch.cat([head.logits[0], mid.logits[0], tail.logits[0]]), paths


def _runs_job(group, folders, runs):
    out = []
    for dtype, graph, mode, moe in runs:
        rt = RuntimeConfig(dtype=dtype, graph=graph, kv_cache=mode, moe=moe, kv_tokens=4096)
        res = _run(PrefillEngine(folders[dtype], rt, group, BUCKETS))
        out.append(res if group.rank == 0 else None)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_rank_matches_transformers_and_the_pieces_one_shot(folders, reference, dtype):
    one, pieces, paths = _run(PrefillEngine(folders[dtype], RuntimeConfig(dtype=dtype, kv_tokens=4096)))
    assert paths == {"eager"}
    check_logits(one, reference[dtype], dtype, "one shot")
    check_logits([pieces], [reference[dtype][3]], dtype, "pieces")


@pytest.mark.parametrize("cp", sorted(RUNS))
def test_cp_matches_transformers(folders, reference, cp):
    results = launch(_runs_job, cp, folders, RUNS[cp])[0]
    for (dtype, graph, mode, moe), (one, pieces, paths) in zip(RUNS[cp], results):
        where = (cp, dtype, graph, mode, moe)
        assert paths == {"graph" if graph != "off" else "eager"}, where
        check_logits(one, reference[dtype], dtype, where)
        check_logits([pieces], [reference[dtype][3]], dtype, where)
