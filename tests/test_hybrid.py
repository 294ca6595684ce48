"""Linear-attention hybrids (docs/hybrid.md) against transformers: Qwen3.5's text model
(``Qwen3_5ForCausalLM``, tests/conftest.py's HYBRID_TINY: three Gated DeltaNet layers and a
full-attention one, slow decays so a state carries across hundreds of tokens).

- the chunked gated delta rule equals transformers' (bitwise), and the scan composes
  every block's incoming state as a sequential run reaches it (the maps of each rank's
  blocks, composed in block order, for requests shorter than 2C and a cached prefix);
- the engine at CP 1, 2 and 4, graphs off and breakable: requests of 1 to 600 tokens in
  one batch, every token's logits within 1e-4 (float32) of transformers', and a chunked
  continuation from a cached prefix ending inside a zigzag block equal to one shot;
  bfloat16 within 2e-2 of transformers in bfloat16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import rel_err

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.cp import make_layout
from graphcp.dist import launch
from graphcp.model.hybrid.gdn import (
    augmented_rule,
    block_conv,
    chunk_gated_delta_rule,
    conv_rows,
    query_key,
    varlen_gated_delta_rule,
)
from graphcp.model.hybrid.scan import LinearPlan, compose
from graphcp.model.hybrid.varlen import ChunkSlots, ConvRows, SlotPlan
from graphcp.runtime.capture.buckets import BucketSet

TOL = {"float32": 1e-4, "bfloat16": 2e-2}
LENS = [1, 7, 45, 600]
#: a prefix of the long request, cut inside a zigzag block at CP 2 and 4, and its continuation
SPLIT = 203
BUCKETS = BucketSet((64, 256, 512), padding_factor=64.0)


def _tokens():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 512, n) for n in LENS]


@pytest.fixture(scope="module")
def folder(hf_model_dir):
    return hf_model_dir("qwen3_5_text")


def reference_logits(hf_model, folder, sequences, model_of=None) -> dict:
    """transformers' logits of each sequence, float32 and bfloat16 (``model_of(folder,
    dtype)``: how the reference loads; default the causal-LM fixture)."""
    out = {}
    for dtype in TOL:
        model = (model_of or hf_model)(folder, dtype)
        with torch.no_grad():
            out[dtype] = [model(torch.tensor(t)[None]).logits[0].float() for t in sequences]
    return out


def check_logits(outs, ref, dtype: str, where) -> None:
    """Each of ``outs`` within the dtype's bound of its reference."""
    for got, want in zip(outs, ref, strict=True):
        assert rel_err(got, want) <= TOL[dtype], (where, rel_err(got, want))


@pytest.fixture(scope="module")
def reference(folder, hf_model):
    return reference_logits(hf_model, folder, _tokens())


def test_the_chunked_rule_is_transformers_and_the_scan_composes_every_block():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    T, Hk, Hv, dk, dv = 130, 2, 4, 24, 16
    q, k = torch.randn(1, T, Hk, dk, generator=g), torch.randn(1, T, Hk, dk, generator=g)
    v = torch.randn(1, T, Hv, dv, generator=g)
    decay, beta = -0.05 * torch.rand(1, T, Hv, generator=g), torch.rand(1, T, Hv, generator=g)
    s0 = torch.randn(1, Hv, dk, dv, generator=g)
    ref, ref_state = torch_chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=s0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    qn, kn = query_key(q[0], k[0], Hv // Hk)
    rows = [x.transpose(0, 1)[None] for x in (qn, kn, v[0], decay[0], beta[0])]
    pad = [torch.cat([x, x.new_zeros(*x.shape[:2], 192 - T, *x.shape[3:])], dim=2) for x in rows]
    out, state = chunk_gated_delta_rule(*pad, s0)
    assert torch.equal(out[0, :, :T].transpose(0, 1), ref[0]) and torch.equal(state, ref_state)

    # the scan at C = 4: requests of 3, 11 and 130 tokens (the last extends a cached state)
    C, lens = 4, [3, 11, T]
    plan = make_layout("zigzag", C).plan(lens, [0, 0, 20])
    prefix = torch.zeros(3, Hv, dk, dv)
    prefix[2] = s0[0]
    rows_of = {name: torch.cat([t[:n] for n in lens]) for name, t in
               (("q", qn), ("k", kn), ("v", v[0]), ("g", decay[0]), ("b", beta[0]))}
    maps, plans = [], []
    for r in range(C):
        lp = LinearPlan.build(plan, r, np.array([-1, -1, 0]), np.array([1, 3, 5]), 4)
        local = torch.from_numpy(plan.rank(r).rows.copy())
        rows = [rows_of[n].index_select(0, local) for n in ("q", "k", "v", "g", "b")]
        known = torch.from_numpy(lp.block_index == 0)
        _, _, x, y = augmented_rule(*rows, prefix.index_select(0, torch.from_numpy(lp.block_request)), known,
                                    varlen_rule(lp.cu))
        maps.append((x, y))
        plans.append(lp)
    xs, ys = torch.cat([m[0] for m in maps]), torch.cat([m[1] for m in maps])
    incoming, final = compose(xs, ys, torch.from_numpy(plans[0].compose), prefix)
    starts = np.cumsum([0] + lens)
    for j, n in enumerate(lens):
        ends = np.cumsum([0] + [(n + 2 * C - 1 - b) // (2 * C) for b in range(2 * C)])
        for b in range(2 * C + 1):  # each block's incoming state, then the final one
            sl = slice(starts[j], starts[j] + int(ends[b]))
            seq = [x[sl].transpose(0, 1)[None] for x in (rows_of["q"], rows_of["k"], rows_of["v"], rows_of["g"],
                                                          rows_of["b"])]
            length = seq[0].shape[2]
            padded = -(-max(length, 1) // 64) * 64
            seq = [torch.cat([x, x.new_zeros(*x.shape[:2], padded - length, *x.shape[3:])], dim=2) for x in seq]
            _, want = chunk_gated_delta_rule(*seq, prefix[j:j + 1])
            got = incoming[j, b] if b < 2 * C else final[j]
            assert rel_err(got, want[0]) < 1e-5, (j, b)


def varlen_rule(cu: np.ndarray):
    """The torch varlen rule over blocks ``cu`` (q and k already normalised)."""
    sp = SlotPlan.build(cu, 64)
    slots = ChunkSlots(*(torch.from_numpy(a) for a in (sp.rows, sp.position, sp.order, sp.inverse)), sp.steps)
    return lambda q, k, v, g, b, s0: varlen_gated_delta_rule(q, k, v, g, b, s0, slots)


def test_the_varlen_rule_and_convolution_equal_the_padded_blocks():
    """Blocks of 0 to 200 rows as one varlen batch (each padded to its own chunks only):
    every output and final state equal to the padded form's, and the convolution over
    the extended rows (halo, then the block) bit for bit block_conv's."""
    from graphcp.model.hybrid.varlen import conv_rows as conv_layout

    g = torch.Generator().manual_seed(3)
    lens, H, dk, dv, K, C = [70, 0, 1, 200, 64, 5], 2, 16, 8, 4, 12
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    n, nb = int(cu[-1]), len(lens)
    q, k = (query_key(torch.randn(n, H, dk, generator=g), torch.randn(n, H, dk, generator=g), 1))
    v, decay, beta = torch.randn(n, H, dv, generator=g), -0.05 * torch.rand(n, H, generator=g), torch.rand(n, H,
                                                                                                           generator=g)
    s0 = torch.randn(nb, H, dk, dv, generator=g)
    out, final = varlen_rule(cu)(q, k, v, decay, beta, s0)
    T = 256
    for b in range(nb):
        sl = slice(int(cu[b]), int(cu[b + 1]))
        pad = [torch.cat([x[sl], x.new_zeros(T - lens[b], *x.shape[1:])]).movedim(0, 1)[None]
               for x in (q, k, v, decay, beta)]
        want, want_state = chunk_gated_delta_rule(*pad, s0[b:b + 1])
        assert rel_err(out[sl], want[0, :, :lens[b]].movedim(0, 1)) <= 1e-6, b
        assert rel_err(final[b], want_state[0]) <= 1e-6, b

    for dtype in (torch.float32, torch.bfloat16):
        rows = torch.randn(n, C, generator=g).to(dtype)
        halos = torch.randn(nb, K - 1, C, generator=g).to(dtype)
        weight = torch.randn(C, K, generator=g).to(dtype)
        halo_index = np.arange(nb * (K - 1), dtype=np.int64).reshape(nb, K - 1)
        ext, seq, keep = conv_layout(cu, halo_index, nb * (K - 1))
        source = torch.cat([halos.reshape(-1, C), rows])
        got = conv_rows(source, ConvRows(*(torch.from_numpy(a) for a in (ext, seq, keep)), K), weight)
        for b in range(nb):
            sl = slice(int(cu[b]), int(cu[b + 1]))
            want = block_conv(rows[sl][None], halos[b:b + 1], weight)[0]
            assert torch.equal(got[sl], want), (dtype, b)
        assert (seq[keep] == np.repeat(np.arange(nb), lens)).all()


def _run(eng: PrefillEngine) -> tuple[list, list, set]:
    """The batch in one forward, then the long request again as a prefix of SPLIT tokens
    and its continuation; every token's logits of both, and the paths the forwards took."""
    toks = _tokens()
    one = eng.prefill([Request(t) for t in toks], all_logits=True)
    for h in one.handles:
        eng.release(h)
    head = eng.prefill([Request(toks[3][:SPLIT])], all_logits=True)
    tail = eng.prefill([Request(toks[3][SPLIT:], head.handles[0]), Request(toks[1])], all_logits=True)
    for h in tail.handles:
        eng.release(h)
    paths = {one.info.path, head.info.path, tail.info.path}
    return [x.clone() for x in one.logits], [torch.cat([head.logits[0], tail.logits[0]]), tail.logits[1]], paths


def _runs_job(group, folder, runs):
    out = []
    for dtype, graph in runs:
        eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, graph=graph, kv_tokens=4096), group, BUCKETS)
        out.append(_run(eng) if group.rank == 0 else _run(eng) and None)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_rank_matches_transformers_and_a_continuation_one_shot(folder, reference, dtype):
    eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=4096))
    one, chunked, _ = _run(eng)
    check_logits(one, reference[dtype], dtype, "one shot")
    check_logits(chunked, [reference[dtype][3], reference[dtype][1]], dtype, "chunked")


@pytest.mark.parametrize("cp,runs", [(2, [("float32", "off"), ("float32", "breakable"), ("bfloat16", "off")]),
                                     (4, [("float32", "breakable")])])
def test_cp_matches_transformers(folder, reference, cp, runs):
    results = launch(_runs_job, cp, folder, runs)[0]
    for (dtype, graph), (one, chunked, paths) in zip(runs, results):
        where = (cp, dtype, graph)
        assert paths == {"graph" if graph != "off" else "eager"}, where
        check_logits(one, reference[dtype], dtype, where)
        check_logits(chunked, [reference[dtype][3], reference[dtype][1]], dtype, where)


def test_the_varlen_layouts_compiled_equal_their_numpy_twins():
    """The scan's host layouts (graphcp.model.hybrid.varlen): the compiled kernels write what
    their numpy twins (what runs without numba) write, over blocks of 0 to 300 rows, one
    block, none with rows, and halos of 1 to 3 rows."""
    from graphcp.model.hybrid import varlen

    rng = np.random.default_rng(9)
    cases = [[0], [5], [0, 0], [64, 0, 1, 300, 63, 65]] + [list(rng.integers(0, 300, rng.integers(1, 12)))
                                                            for _ in range(20)]
    for lens in cases:
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        nb, n = len(lens), int(cu[-1])
        width = int(rng.integers(1, 4))
        halo = rng.integers(0, 50, (nb, width)).astype(np.int64)
        got = [np.full(n + nb * width, -7), np.full(n + nb * width, -7), np.full(n, -7)]
        want = [a.copy() for a in got]
        varlen._conv_rows(cu, halo, 50, *got)
        varlen._conv_rows_np(cu, halo, 50, *want)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), lens
        sp = SlotPlan.build(cu, 64)
        rows, position = np.full_like(sp.rows, -7), np.full_like(sp.position, -7)
        varlen._slot_rows_np(cu, sp.order, sp.inverse, np.array(sp.steps), 64, rows, position)
        assert np.array_equal(rows, sp.rows) and np.array_equal(position, sp.position), lens
        assert (np.sort(sp.rows[sp.rows < n]) == np.arange(n)).all() and (sp.rows[sp.position] == np.arange(n)).all()
