"""The attention reference harness (``graphcp.attention.reference_cases``) that the
backend tests and the GPU check share: its hand-built plans agree with graphcp's
layouts, its paged metadata is what it says, and its comparison fails where it must."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from graphcp.attention.backends.torch_ref import TorchAttention
from graphcp.attention.base import AttentionSpec
from graphcp.attention.reference_cases import (
    SENTINEL,
    TOLERANCE,
    RankBatch,
    build_case,
    edge_and_random_batches,
    paged_metadata,
    run_on_case,
    zigzag_plan,
)
from graphcp.cp import make_layout


@pytest.mark.parametrize("layout", ["zigzag", "interleave"])
def test_hand_built_plans_match_the_layouts(layout):
    """Written apart from graphcp.cp, the harness's plans give every rank the same
    segments as the layout's own plan (prefixes, requests shorter than 2C)."""
    rng = np.random.default_rng(0)
    batches = [([40, 3], [20, 0], 2), ([1, 7, 30], [0, 5, 64], 4)]
    batches += [([int(x) for x in rng.integers(1, 50, 3)], [int(x) for x in rng.integers(0, 30, 3)], 3)]
    for extend, prefix, cp in batches:
        plan = make_layout(layout, cp).plan(extend, prefix)
        for r in range(cp):
            got = RankBatch(layout, cp, r, extend, prefix).plan()
            rp = plan.rank(r)
            assert (got.q_lens, got.kv_lens, got.seg_request) == (
                rp.seg_q_len.tolist(), rp.seg_kv_len.tolist(), rp.seg_request.tolist())


def test_paged_metadata_in_order_scattered_and_padded():
    plan = zigzag_plan([40, 3], [20, 0], cp=2, rank=0)
    meta, pages = paged_metadata(plan, 16, width=8)
    assert pages == 6 and meta.page_table_host[:, :4].tolist() == [[1, 2, 3, 4], [1, 2, 3, 4], [5, 0, 0, 0], [5, 0, 0, 0]]
    meta, pages = paged_metadata(plan, 16, slots=6, rng=np.random.default_rng(1), spare_pages=3)
    assert pages == 9 and meta.page_table_host.shape == (6, 5)  # the longest request's 4 pages + a spare column
    owned = [set(meta.page_table_host[0, :4].tolist()), set(meta.page_table_host[2, :1].tolist())]
    assert len(owned[0]) == 4 and owned[0].isdisjoint(owned[1]) and all(0 < p < pages for o in owned for p in o)
    assert not meta.page_table_host[2, 1:].any() and not meta.page_table_host[4:].any()
    assert meta.cu_seqlens_q_host.tolist() == [0, 10, 20, 21, 21, 21, 21] and meta.kv_lens_host[4:].tolist() == [0, 0]
    with pytest.raises(ValueError, match="more than slots=3"):
        paged_metadata(plan, 16, slots=3)


def test_check_batches_have_edges_and_empty_segments():
    batches = edge_and_random_batches(np.random.default_rng(0), 3, max_extend=24, max_prefix=20)
    assert len(batches) == 5 and any(0 in b.plan().q_lens for b in batches)
    assert any(p > 0 for b in batches for p in b.prefix)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_comparison_passes_the_reference_and_fails_wrong_outputs(dtype):
    spec = AttentionSpec(4, 2, 64, 16, 0.125, "HND")
    case = build_case(zigzag_plan([37, 3], [9, 0], 2, 1), spec, dtype, "cpu", torch.Generator().manual_seed(0),
                      np.random.default_rng(0), slots=8)
    assert case.kv("HND").shape == (case.num_pages, 2, 2, 16, 64)
    ok = run_on_case(TorchAttention(spec), case)
    assert ok.ok and ok.out <= TOLERANCE[dtype] and ok.lse is not None and ok.padding_untouched

    class Wrong(TorchAttention):
        def __init__(self, spec, how):
            super().__init__(spec)
            self.how = how

        def forward(self, q, kv_cache, meta, out, lse=None):
            super().forward(q, kv_cache, meta, out, lse)
            n = meta.num_q_rows
            if self.how == "scale":
                out[:n] *= 1.1
            elif self.how == "padding":
                out[n] = 0.0
            elif self.how == "base2 lse":
                lse[:n] /= math.log(2.0)
            elif self.how == "nan":
                out[0, 0, 0] = float("nan")

    for how in ("scale", "padding", "base2 lse", "nan"):
        bad = run_on_case(Wrong(spec, how), case)
        assert not bad.ok, how
    assert run_on_case(Wrong(spec, "nan"), case).out == math.inf
    assert "WRITTEN" in str(run_on_case(Wrong(spec, "padding"), case))
    assert (case.q[case.meta.num_q_rows:] != SENTINEL).any()  # the inputs themselves are random
