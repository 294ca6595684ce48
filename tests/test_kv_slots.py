"""The gathered KV slot mapping (per page run) against a per-token reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcp.cp import InterleaveLayout, ZigzagLayout
from graphcp.kv_slots import gathered_slots


def _table(rng, lens: list[int], page_size: int, width_extra: int) -> tuple[np.ndarray, np.ndarray]:
    """A dense page table with shuffled distinct pages per request, its rows shuffled too."""
    pages = [-(-n // page_size) for n in lens]
    width = max(pages) + width_extra
    rows = rng.permutation(len(lens) + 2)[: len(lens)]  # some table rows unused
    table = np.zeros((len(lens) + 2, width), dtype=np.int32)
    ids = rng.permutation(np.arange(1, sum(pages) + 1))
    at = 0
    for j, p in enumerate(pages):
        table[rows[j], :p] = ids[at : at + p]
        at += p
    return table, rows.astype(np.int64)


def _reference(plan, capacity, rows, table, page_size) -> np.ndarray:
    want = np.full(plan.cp_size * capacity, -1, dtype=np.int64)
    req, pos = plan.token_request, plan.token_position
    slot = table[rows[req], pos // page_size].astype(np.int64) * page_size + pos % page_size
    want[plan.gather_index(capacity)] = slot
    return want


@settings(max_examples=150, deadline=None)
@given(
    cp=st.integers(1, 8),
    ext=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    data=st.data(),
    page_size=st.sampled_from([1, 3, 16, 64]),
    layout=st.sampled_from([ZigzagLayout, InterleaveLayout]),
    extra=st.integers(0, 9),
    seed=st.integers(0, 2**31),
)
def test_gathered_slots_match_per_token_reference(cp, ext, data, page_size, layout, extra, seed):
    pre = data.draw(st.lists(st.integers(0, 100), min_size=len(ext), max_size=len(ext)))
    plan = layout(cp).plan(ext, pre)
    rng = np.random.default_rng(seed)
    table, rows = _table(rng, [p + n for p, n in zip(pre, ext)], page_size, width_extra=rng.integers(0, 3))
    capacity = plan.max_local_rows + extra
    want = _reference(plan, capacity, rows, table, page_size)
    got = gathered_slots(plan.gather_blocks, plan.local_rows, capacity, rows, table, page_size)
    np.testing.assert_array_equal(got, want)
    # written in place into a caller's buffer, whatever it held before
    out = np.full(cp * capacity, 12345, dtype=np.int64)
    assert gathered_slots(plan.gather_blocks, plan.local_rows, capacity, rows, table, page_size, out) is out
    np.testing.assert_array_equal(out, want)


def test_padding_rows_are_minus_one_and_live_rows_are_distinct():
    plan = ZigzagLayout(4).plan([1, 7, 100], [0, 5, 33])
    rng = np.random.default_rng(0)
    table, rows = _table(rng, [1, 12, 133], 16, 0)
    cap = plan.padded_rows(8) + 8
    got = gathered_slots(plan.gather_blocks, plan.local_rows, cap, rows, table, 16)
    live = got[got >= 0]
    assert live.size == plan.num_tokens and np.unique(live).size == live.size
    for r, n in enumerate(plan.local_rows):
        assert (got[r * cap + n : (r + 1) * cap] == -1).all()
        assert (got[r * cap : r * cap + n] >= 16).all()  # never the scratch page 0


def test_bad_out_and_capacity_are_named():
    plan = ZigzagLayout(2).plan([10, 20])
    table, rows = _table(np.random.default_rng(0), [10, 20], 16, 0)
    with pytest.raises(ValueError, match="out must be int64 \\[64\\]"):
        gathered_slots(plan.gather_blocks, plan.local_rows, 32, rows, table, 16, np.empty(10, np.int64))
    with pytest.raises(ValueError, match="capacity 4 is smaller than the largest rank's 15 rows"):
        gathered_slots(plan.gather_blocks, plan.local_rows, 4, rows, table, 16)
