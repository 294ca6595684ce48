"""Tests of the CP layouts (graphcp.cp): zigzag and interleave plans.

Every property is checked against the definitions in docs/design.md ("Layouts"): each
new token owned by exactly one rank, each local row's segment giving it exactly its
causal history, the gather index inverting a rank-major all-gather, and the
last-token bookkeeping. Zigzag is also compared with a plain per-request reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphcp.cp import (
    InterleaveLayout,
    Layout,
    Plan,
    RankPlan,
    ZigzagLayout,
    causal_work_per_rank,
    make_layout,
)

LAYOUT_NAMES = ("zigzag", "interleave")


# --------------------------------------------------------------------------- strategies


@st.composite
def batches(draw, max_len: int = 2000, max_requests: int = 16):
    """(cp_size, extend_lens, prefix_lens) with some very short requests mixed in."""
    cp = draw(st.integers(1, 8))
    num = draw(st.integers(1, max_requests))
    short = st.integers(1, 2 * cp + 1)
    ext = draw(st.lists(st.one_of(st.integers(1, max_len), short), min_size=num, max_size=num))
    pre = draw(st.lists(st.integers(0, 500), min_size=num, max_size=num))
    return cp, ext, pre


SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# --------------------------------------------------------------------------- references


def zigzag_reference(cp: int, ext: list[int], pre: list[int]):
    """Straight from the definition: per rank, its rows and segments (Python loops)."""
    c2 = 2 * cp
    rows: list[list[int]] = [[] for _ in range(cp)]
    segs: list[list[tuple[int, int, int]]] = [[] for _ in range(cp)]
    start = 0
    for j, (length, prefix) in enumerate(zip(ext, pre)):
        base, rem = divmod(length, c2)
        sizes = [base + (1 if k < rem else 0) for k in range(c2)]
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        for r in range(cp):
            for k in (r, c2 - 1 - r):
                rows[r].extend(range(start + bounds[k], start + bounds[k + 1]))
                segs[r].append((j, sizes[k], prefix + bounds[k + 1]))
        start += length
    return rows, segs


def rank_major_gather(plan: Plan, capacity: int) -> np.ndarray:
    """Simulate a rank-major all-gather of every rank's padded local global-row ids."""
    gathered = np.full(plan.cp_size * capacity, -1, dtype=np.int64)
    for r in range(plan.cp_size):
        rows = plan.rank(r).rows
        gathered[r * capacity : r * capacity + rows.shape[0]] = rows
    return gathered


def check_plan(plan: Plan, ext: list[int], pre: list[int]) -> None:
    """Every layout-independent invariant of a plan."""
    cp = plan.cp_size
    ext_a = np.asarray(ext, dtype=np.int64)
    pre_a = np.asarray(pre, dtype=np.int64)
    total = int(ext_a.sum())
    num = len(ext)

    # batch-level attributes
    assert plan.num_requests == num
    assert plan.num_tokens == total
    np.testing.assert_array_equal(plan.extend_lens, ext_a)
    np.testing.assert_array_equal(plan.prefix_lens, pre_a)
    np.testing.assert_array_equal(plan.cu_extend, np.concatenate([[0], np.cumsum(ext_a)]))
    for name in ("extend_lens", "prefix_lens", "cu_extend"):
        assert getattr(plan, name).dtype == np.int64

    # global per-token maps
    tok_req = np.repeat(np.arange(num), ext_a)
    tok_pos = np.concatenate([p + np.arange(n) for n, p in zip(ext, pre)])
    np.testing.assert_array_equal(plan.token_request, tok_req)
    np.testing.assert_array_equal(plan.token_position, tok_pos)
    assert plan.owner.shape == (total,) and plan.local_index.shape == (total,)
    assert plan.owner.dtype == np.int64 and plan.local_index.dtype == np.int64

    seen = np.zeros(total, dtype=np.int64)
    assert len(plan.local_rows) == cp
    assert all(type(n) is int for n in plan.local_rows)
    assert plan.max_local_rows == max(plan.local_rows)
    for r in range(cp):
        rp = plan.rank(r)
        assert isinstance(rp, RankPlan) and rp.rank == r
        assert plan.rank(r) is rp  # cached
        n = rp.num_rows
        assert n == plan.local_rows[r]
        for name in ("rows", "positions", "row_request", "seg_request", "seg_q_len", "seg_kv_len"):
            assert getattr(rp, name).dtype == np.int64, name
        assert rp.cu_seqlens_q.dtype == np.int32
        assert rp.rows.shape == rp.positions.shape == rp.row_request.shape == (n,)

        # ownership and consistency with the global maps
        seen[rp.rows] += 1
        np.testing.assert_array_equal(plan.owner[rp.rows], r)
        np.testing.assert_array_equal(plan.local_index[rp.rows], np.arange(n))
        np.testing.assert_array_equal(rp.positions, tok_pos[rp.rows])
        np.testing.assert_array_equal(rp.row_request, tok_req[rp.rows])

        # segments: contiguous runs of local rows covering all of them
        nseg = rp.num_segments
        q, kv, cu = rp.seg_q_len, rp.seg_kv_len, rp.cu_seqlens_q
        assert rp.seg_request.shape == q.shape == kv.shape == (nseg,)
        assert cu.shape == (nseg + 1,)
        np.testing.assert_array_equal(cu, np.concatenate([[0], np.cumsum(q)]))
        assert int(cu[-1]) == n
        assert (q >= 0).all()
        segs = rp.segments
        assert segs == [(int(a), int(b), int(c)) for a, b, c in zip(rp.seg_request, q, kv)]
        assert all(type(x) is int for s in segs for x in s)

        # causal history: row i of a segment sees positions < kv - q + i + 1,
        # which must be exactly [0, its own position] of its own request
        seg_of_row = np.repeat(np.arange(nseg), q)
        offset = np.arange(n) - cu[seg_of_row]
        visible = kv[seg_of_row] - q[seg_of_row] + offset + 1
        np.testing.assert_array_equal(visible, rp.positions + 1)
        np.testing.assert_array_equal(rp.seg_request[seg_of_row], rp.row_request)
        # a segment never sees past its request's end
        assert (kv <= pre_a[rp.seg_request] + ext_a[rp.seg_request]).all()
    np.testing.assert_array_equal(seen, 1)  # every new token owned exactly once

    # gather index inverts a rank-major all-gather at any capacity that fits
    for cap in {plan.max_local_rows, plan.padded_rows(8), plan.max_local_rows + 5}:
        gi = plan.gather_index(cap)
        assert gi.dtype == np.int64 and gi.shape == (total,)
        np.testing.assert_array_equal(gi, plan.owner * cap + plan.local_index)
        np.testing.assert_array_equal(rank_major_gather(plan, cap)[gi], np.arange(total))

    # last tokens
    assert plan.last_owner.shape == plan.last_local_index.shape == (num,)
    for j in range(num):
        rp = plan.rank(int(plan.last_owner[j]))
        assert rp.rows[plan.last_local_index[j]] == plan.cu_extend[j + 1] - 1

    # causal work helper
    work = causal_work_per_rank(plan)
    expect = [int((plan.rank(r).positions + 1).sum()) for r in range(cp)]
    np.testing.assert_array_equal(work, expect)


# --------------------------------------------------------------------------- properties


@SETTINGS
@given(batches())
def test_zigzag_invariants_and_reference(batch):
    cp, ext, pre = batch
    plan = ZigzagLayout(cp).plan(ext, pre)
    check_plan(plan, ext, pre)
    ref_rows, ref_segs = zigzag_reference(cp, ext, pre)
    for r in range(cp):
        rp = plan.rank(r)
        np.testing.assert_array_equal(rp.rows, ref_rows[r])
        assert rp.segments == ref_segs[r]
        assert rp.num_segments == 2 * len(ext)  # static: empty blocks included


@SETTINGS
@given(batches())
def test_interleave_invariants(batch):
    cp, ext, pre = batch
    plan = InterleaveLayout(cp).plan(ext, pre)
    check_plan(plan, ext, pre)
    total = sum(ext)
    for r in range(cp):
        rp = plan.rank(r)
        np.testing.assert_array_equal(rp.rows, np.arange(r, total, cp))
        np.testing.assert_array_equal(rp.seg_q_len, 1)
        np.testing.assert_array_equal(rp.seg_kv_len, rp.positions + 1)
        np.testing.assert_array_equal(rp.seg_request, rp.row_request)


@settings(max_examples=40, deadline=None)
@given(
    cp=st.integers(1, 8),
    data=st.data(),
)
def test_zigzag_balanced_for_long_requests(cp, data):
    num = data.draw(st.integers(1, 16))
    ext = data.draw(st.lists(st.integers(64 * cp, 4000), min_size=num, max_size=num))
    pre = data.draw(st.lists(st.integers(0, 500), min_size=num, max_size=num))
    work = causal_work_per_rank(ZigzagLayout(cp).plan(ext, pre))
    assert work.max() / work.mean() <= 1.05


def test_default_prefix_is_zero():
    plan = ZigzagLayout(2).plan([5, 7])
    np.testing.assert_array_equal(plan.prefix_lens, [0, 0])
    check_plan(plan, [5, 7], [0, 0])


def test_numpy_inputs_are_copied():
    ext = np.array([10, 20], dtype=np.int32)
    pre = np.array([3, 0], dtype=np.int64)
    plan = ZigzagLayout(2).plan(ext, pre)
    ext[0] = 99
    pre[0] = 99
    assert plan.extend_lens.tolist() == [10, 20] and plan.prefix_lens.tolist() == [3, 0]
    check_plan(plan, [10, 20], [3, 0])


# --------------------------------------------------------------------------- examples


def test_documented_example():
    plan = ZigzagLayout(cp_size=4).plan(extend_lens=[1534, 161, 353])
    assert plan.local_rows == [513, 511, 512, 512]
    assert plan.max_local_rows == 513
    assert plan.padded_rows(8) == 520
    assert plan.padded_rows(1) == 513
    # request 0: 1534 = 8 * 191 + 6 -> blocks 0..5 have 192 rows, 6..7 have 191;
    # rank 1 owns block 1 (rows 192..383) and block 6 (rows 1152..1342)
    rp = plan.rank(1)
    assert rp.segments[:2] == [(0, 192, 384), (0, 191, 1343)]
    assert rp.rows[0] == 192 and rp.rows[192] == 1152
    check_plan(plan, [1534, 161, 353], [0, 0, 0])


def test_zigzag_hand_worked():
    # C = 2, L = 10: blocks [3, 3, 2, 2]; rank 0 owns blocks 0 and 3, rank 1 blocks 1 and 2
    plan = ZigzagLayout(2).plan([10], [4])
    r0, r1 = plan.rank(0), plan.rank(1)
    assert r0.rows.tolist() == [0, 1, 2, 8, 9]
    assert r0.positions.tolist() == [4, 5, 6, 12, 13]
    assert r0.segments == [(0, 3, 7), (0, 2, 14)]
    assert r0.cu_seqlens_q.tolist() == [0, 3, 5]
    assert r1.rows.tolist() == [3, 4, 5, 6, 7]
    assert r1.segments == [(0, 3, 10), (0, 2, 12)]
    assert plan.last_owner.tolist() == [0] and plan.last_local_index.tolist() == [4]
    assert plan.gather_index(5).tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 3, 4]


def test_zigzag_short_and_single_token_requests():
    cp = 4
    ext = [1, 3, 7, 8, 9, 1]  # all shorter than or close to 2C = 8
    pre = [0, 10, 0, 5, 0, 100]
    plan = ZigzagLayout(cp).plan(ext, pre)
    check_plan(plan, ext, pre)
    # a single-token request lives in block 0 on rank 0; its other segments are empty
    assert plan.rank(0).segments[0] == (0, 1, 1)
    for r in range(1, cp):
        assert plan.rank(r).segments[0][1] == 0
    assert plan.last_owner[0] == 0 and plan.last_owner[5] == 0
    # L = 3 < 2C: blocks 0, 1, 2 hold one token each, the last one is on rank 2
    assert plan.last_owner[1] == 2
    for r in range(cp):
        assert plan.rank(r).num_segments == 2 * len(ext)


def test_zigzag_cp1():
    plan = ZigzagLayout(1).plan([5, 1], [2, 0])
    rp = plan.rank(0)
    assert rp.rows.tolist() == list(range(6))
    # blocks 0 and 1 both on rank 0: early [3 rows] then late [2 rows]; request 1: [1], []
    assert rp.segments == [(0, 3, 5), (0, 2, 7), (1, 1, 1), (1, 0, 1)]
    check_plan(plan, [5, 1], [2, 0])


def test_interleave_example():
    plan = InterleaveLayout(3).plan([3, 4], [1, 0])
    assert plan.local_rows == [3, 2, 2]
    assert plan.rank(1).rows.tolist() == [1, 4]
    assert plan.rank(1).segments == [(0, 1, 3), (1, 1, 2)]
    assert plan.gather_index(3).tolist() == [0, 3, 6, 1, 4, 7, 2]
    assert plan.last_owner.tolist() == [2, 0] and plan.last_local_index.tolist() == [0, 2]


def test_fewer_tokens_than_ranks():
    for layout in (ZigzagLayout(8), InterleaveLayout(8)):
        plan = layout.plan([2, 1])
        check_plan(plan, [2, 1], [0, 0])
        assert sum(plan.local_rows) == 3
        assert plan.max_local_rows == 1 if layout.name == "interleave" else plan.max_local_rows >= 1


# --------------------------------------------------------------------------- API


def test_make_layout():
    for name, cls in (("zigzag", ZigzagLayout), ("interleave", InterleaveLayout)):
        layout = make_layout(name, 4)
        assert isinstance(layout, cls) and isinstance(layout, Layout)
        assert layout.name == name and layout.cp_size == 4
        plan = layout.plan([10, 20])
        assert isinstance(plan, Plan) and plan.cp_size == 4
    assert make_layout("zigzag", 2) == ZigzagLayout(2)
    with pytest.raises(ValueError, match=r"unknown CP layout 'ring'.*interleave.*zigzag"):
        make_layout("ring", 2)


def test_plan_is_read_only():
    plan = ZigzagLayout(2).plan([10, 3])
    with pytest.raises(AttributeError):
        plan.cp_size = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        plan.local_rows = [1, 2]  # type: ignore[misc]
    rp = plan.rank(0)
    with pytest.raises(AttributeError):
        rp.rows = np.zeros(3)  # type: ignore[misc]
    for arr in (plan.extend_lens, plan.cu_extend, plan.owner, plan.last_owner, rp.rows,
                rp.positions, rp.seg_q_len, rp.seg_kv_len, rp.cu_seqlens_q, rp.seg_request):
        with pytest.raises(ValueError):
            arr[0] = 7
    # the gather index is the caller's to keep (e.g. to copy into a static buffer)
    gi = plan.gather_index(16)
    gi[0] = 5


@pytest.mark.parametrize("name", LAYOUT_NAMES)
@pytest.mark.parametrize(
    "ext, pre, message",
    [
        ([], None, r"empty batch"),
        ([4, 0, 2], None, r"extend_lens\[1\] = 0: every request needs at least 1 new token"),
        ([4, 3, -2], None, r"extend_lens\[2\] = -2"),
        ([4, 3], [0, -1], r"prefix_lens\[1\] = -1: prefix lengths must be >= 0"),
        ([4, 3], [0], r"prefix_lens has 1 entries but extend_lens has 2 requests"),
        ([4, 3.5], None, r"extend_lens must be integers, got dtype float64"),
        ([[4, 3]], None, r"extend_lens must be a 1-D sequence of integers, got shape \(1, 2\)"),
        ([True, True], None, r"extend_lens must be integers, got dtype bool"),
    ],
)
def test_bad_lengths(name, ext, pre, message):
    with pytest.raises(ValueError, match=message):
        make_layout(name, 2).plan(ext, pre)


@pytest.mark.parametrize("cp", [0, -1, 1.5, True, "2"])
def test_bad_cp_size(cp):
    for cls in (ZigzagLayout, InterleaveLayout):
        with pytest.raises(ValueError, match=r"cp_size must be an integer >= 1, got"):
            cls(cp)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_bad_capacity_rank_align(name):
    plan = make_layout(name, 4).plan([1534, 161, 353])
    with pytest.raises(ValueError, match=r"capacity 100 is smaller than the largest rank's local"):
        plan.gather_index(100)
    plan.gather_index(plan.max_local_rows)  # exact fit is fine
    for bad in (-1, 4, 1.0):
        with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 4\)"):
            plan.rank(bad)  # type: ignore[arg-type]
    assert plan.rank(np.int64(2)) is plan.rank(2)
    with pytest.raises(ValueError, match=r"align must be an integer >= 1, got 0"):
        plan.padded_rows(0)
