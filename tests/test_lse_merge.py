"""The LSE merge against one softmax over the concatenated KV: random splits of the
keys into blocks (empty blocks included), rows that some blocks do not touch
(LSE -inf), bfloat16 partial outputs, large score magnitudes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcp.attention.ring.merge import merge_states


def _attend(q, k, v, visible):
    """float64 attention of q [n, H, D] over k/v [m, H, D] where ``visible`` [n, m]:
    (output, natural-log LSE); rows that see nothing: output 0, LSE -inf."""
    s = torch.einsum("nhd,mhd->nhm", q, k)
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    return torch.einsum("nhm,mhd->nhd", p, v), lse


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 9),
    keys=st.integers(1, 40),
    blocks=st.integers(1, 6),
    scale=st.sampled_from([1.0, 30.0, 300.0]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
)
def test_merge_equals_one_softmax(seed, rows, keys, blocks, scale, dtype):
    g = torch.Generator().manual_seed(seed)
    heads, dim = 2, 8
    q = torch.randn(rows, heads, dim, generator=g, dtype=torch.float64) * scale
    k = torch.randn(keys, heads, dim, generator=g, dtype=torch.float64)
    v = torch.randn(keys, heads, dim, generator=g, dtype=torch.float64)
    # every row sees a random non-empty subset; the blocks are a random split of the keys
    visible = torch.rand(rows, keys, generator=g) < 0.6
    visible[torch.arange(rows), torch.randint(0, keys, (rows,), generator=g)] = True
    cuts = sorted(torch.randint(0, keys + 1, (blocks - 1,), generator=g).tolist())
    bounds = list(zip([0] + cuts, cuts + [keys]))  # empty blocks where cuts repeat
    want_out, want_lse = _attend(q, k, v, visible)
    outs, lses = [], []
    for a, b in bounds:
        o, lse = _attend(q, k[a:b], v[a:b], visible[:, a:b])
        outs.append(o.to(getattr(torch, dtype)))  # what a backend writes: the model dtype
        lses.append(lse.float())
    got_out, got_lse = merge_states(outs, lses)
    assert got_out.dtype == torch.float32 and got_lse.dtype == torch.float32
    assert torch.isfinite(got_out).all() and torch.isfinite(got_lse).all()
    # the blocks' LSEs are float32: each carries half an ulp of its magnitude, so the
    # weights exp(lse_b - lse) are off by ~2 ulps of the largest |LSE| relative (at
    # scale 300 the LSEs reach ~2000, an ulp ~1.2e-4): the output's float32 bound
    lse_mag = float(want_lse[torch.isfinite(want_lse)].abs().max())
    tol = 1e-5 + 2 * torch.finfo(torch.float32).eps * lse_mag if dtype == "float32" else 1e-2
    torch.testing.assert_close(got_lse.double(), want_lse, rtol=1e-6, atol=1e-5 * max(1.0, scale))
    torch.testing.assert_close(got_out.double(), want_out, rtol=tol, atol=tol)
    # the running (in place, pairwise) form the pass-KV ring uses gives the same
    acc, acc_lse = outs[0].float().clone(), lses[0].clone()
    for o, lse in zip(outs[1:], lses[1:]):
        merge_states([acc, o], [acc_lse, lse], acc, acc_lse)
    torch.testing.assert_close(acc, got_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc_lse, got_lse, rtol=1e-6, atol=1e-5)


def test_rows_no_block_touches_are_zero_and_minus_inf_not_nan():
    out = torch.randn(3, 2, 4)
    lse = torch.full((3, 2), float("-inf"))
    lse[0] = 1.5  # row 0 touched by the first block only
    out2 = torch.zeros(3, 2, 4)
    lse2 = torch.full((3, 2), float("-inf"))
    merged, merged_lse = merge_states([out, out2], [lse, lse2])
    assert not merged.isnan().any() and not merged_lse.isnan().any()
    torch.testing.assert_close(merged[0], out[0])
    assert torch.equal(merged[1:], torch.zeros(2, 2, 4))
    assert torch.isneginf(merged_lse[1:]).all() and torch.equal(merged_lse[0], lse[0])


def test_huge_scores_do_not_overflow():
    lse = [torch.tensor([[1e4]]), torch.tensor([[1e4 + 1.0]])]  # exp(1e4) overflows any float
    outs = [torch.ones(1, 1, 2), torch.full((1, 1, 2), 5.0)]
    merged, merged_lse = merge_states(outs, lse)
    e = math.e
    torch.testing.assert_close(merged, torch.full((1, 1, 2), (1 + 5 * e) / (1 + e)))  # weights 1 : e
    torch.testing.assert_close(merged_lse, torch.tensor([[1e4 + math.log(1 + e)]]), rtol=0, atol=1e-3)


def test_needs_matching_inputs():
    with pytest.raises(ValueError, match="as many"):
        merge_states([torch.zeros(1, 1, 1)], [])
    assert np.isfinite(merge_states([torch.zeros(1, 1, 1)], [torch.zeros(1, 1)])[1].numpy()).all()
