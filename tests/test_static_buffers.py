"""Static buffers: prefix views per bucket, inert padding, no leak between batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphcp.runtime.capture.static_buffers import StaticBuffers


def _buffers(cp=2, cap=64):
    return StaticBuffers(cap, cp, num_q_heads=2, head_dim=4, hidden_size=8, max_segments=6,
                         max_pages_per_seq=4, dtype=torch.float32, device="cpu")


def test_views_are_prefixes_of_one_allocation():
    b = _buffers()
    v16, v64 = b.view(16), b.view(64)
    assert v16.input_ids.data_ptr() == v64.input_ids.data_ptr() == b.input_ids.data_ptr()
    assert v16.input_ids.shape == (16,) and v16.kv_slots.shape == (16,) and v64.kv_slots.shape == (64,)
    assert v16.attn_q.shape == (16, 2, 4) and v16.hidden_out.shape == (16, 8)


def test_fill_pads_inertly_and_nothing_of_a_larger_batch_leaks():
    b = _buffers()
    big = np.arange(1, 51)
    b.fill(64, big, big + 100, big + 7)
    ids = np.array([5, 6, 7])
    v = b.fill(16, ids, ids + 1, np.array([40, 41, 42]))
    assert v.input_ids.tolist() == [5, 6, 7] + [0] * 13
    assert v.positions.tolist() == [6, 7, 8] + [0] * 13
    assert v.kv_slots.tolist() == [40, 41, 42] + [-1] * 13
    # and back to the larger bucket with a small batch: its whole prefix is rewritten
    v = b.fill(64, ids[:1], ids[:1], np.array([3]))
    assert v.input_ids[1:].eq(0).all() and v.positions[1:].eq(0).all()
    assert v.kv_slots[1:].eq(-1).all() and int(v.kv_slots[0]) == 3


def test_fill_repads_what_earlier_fills_dirtied_across_bucket_sizes():
    """Fill re-pads only rows an earlier fill may have left live; check against a
    full re-pad over a random sequence of bucket sizes and batch sizes."""
    b = _buffers(cap=64)
    rng = np.random.default_rng(0)
    for _ in range(200):
        cap = int(rng.choice([8, 16, 32, 64]))
        n = int(rng.integers(0, cap + 1))
        ids = rng.integers(1, 100, n)
        v = b.fill(cap, ids, ids + 1, ids + 2)
        assert v.input_ids.tolist() == ids.tolist() + [0] * (cap - n)
        assert v.positions.tolist() == (ids + 1).tolist() + [0] * (cap - n)
        assert v.kv_slots.tolist() == (ids + 2).tolist() + [-1] * (cap - n)
    # a replaced tensor holds unknown rows: the next fill pads the whole bucket
    b.input_ids = torch.full_like(b.input_ids, 7)
    v = b.fill(64, np.arange(2), np.arange(2), np.arange(2))
    assert v.input_ids[2:].eq(0).all()


def test_full_graph_segment_metadata_pads_with_empty_segments():
    b = _buffers()
    b.fill(16, np.arange(5), np.arange(5), np.arange(5),
           np.array([0, 3, 5]), np.array([3, 9]), np.array([[1, 2], [3, 4]]))
    assert b.cu_seqlens_q.tolist() == [0, 3, 5, 5, 5, 5, 5]  # empty segments past the batch
    assert b.kv_lens.tolist() == [3, 9, 0, 0, 0, 0]
    assert b.page_table[:2, :2].tolist() == [[1, 2], [3, 4]]


def test_fill_rejects_what_does_not_fit():
    b = _buffers()
    with pytest.raises(ValueError, match="20 local rows do not fit bucket capacity 16"):
        b.fill(16, np.arange(20), np.arange(20), np.arange(20))
    with pytest.raises(ValueError, match="one entry per local row; got 2, 2 and 3"):
        b.fill(16, np.arange(2), np.arange(2), np.arange(3))
    with pytest.raises(ValueError, match="7 segments exceed the buffers' 6"):
        b.fill(16, np.arange(1), np.arange(1), np.arange(1), np.zeros(8, int), np.ones(7, int),
               np.zeros((7, 1), int))


def test_fill_waits_for_the_previous_uploads_before_rewriting_the_staging_buffers():
    """Pinned staging (CUDA): a fill's uploads read the pinned buffers when they run. On
    a pipeline stage before the last nothing synchronises the host between micro-batches,
    so the next fill used to rewrite the buffers while the previous uploads were still
    queued, and the first micro-batch's replay read the second's tokens. With the fake
    copy engine (uploads deferred until a wait or a sync) each replay reads its own batch."""
    from fake_copy_engine import FakeCopyEngine

    eng = FakeCopyEngine()
    b = StaticBuffers(64, 2, num_q_heads=2, head_dim=4, hidden_size=8, max_segments=6, max_pages_per_seq=4,
                      dtype=torch.float32, device="cpu", staging=eng)
    batches = [np.array([11, 12, 13]), np.array([21, 22, 23, 24, 25])]
    seen = []
    for ids in batches:  # two micro-batches, host running ahead (no sync in between)
        v = b.fill(16, ids, ids + 100, ids + 200)
        eng.launch(lambda v=v: seen.append((v.input_ids.clone(), v.positions.clone(), v.kv_slots.clone())))
    eng.sync()
    assert eng.waits == 1  # the second fill waited for the first one's uploads
    for ids, (got_ids, got_pos, got_slots) in zip(batches, seen):
        pad = 16 - ids.size
        assert got_ids.tolist() == ids.tolist() + [0] * pad
        assert got_pos.tolist() == (ids + 100).tolist() + [0] * pad
        assert got_slots.tolist() == (ids + 200).tolist() + [-1] * pad


def test_full_graph_segment_metadata_is_staged_with_the_rows():
    """A full graph's segment metadata (cu_seqlens_q, kv_lens, the live page-table block)
    goes through the pinned staging too, fenced with the rows: it was copied from pageable
    memory, which on CUDA blocks the host until the stream drains, once per array and
    replay. With the fake copy engine (uploads deferred) each replay reads its own batch's
    segments, and a fill queues six uploads."""
    from fake_copy_engine import FakeCopyEngine

    eng = FakeCopyEngine()
    b = StaticBuffers(64, 1, num_q_heads=2, head_dim=4, hidden_size=8, max_segments=3, max_pages_per_seq=4,
                      dtype=torch.float32, device="cpu", staging=eng)
    batches = [(np.array([0, 3, 5], np.int32), np.array([3, 2], np.int32), np.array([[7, 8], [9, 0]], np.int32)),
               (np.array([0, 4], np.int32), np.array([4], np.int32), np.array([[5, 6, 2]], np.int32))]
    seen, queued = [], []
    for cu, kv, pt in batches:
        ids = np.arange(int(cu[-1]))
        before = len(eng.queue)
        v = b.fill(8, ids, ids, ids, cu, kv, pt)
        queued.append(len(eng.queue) - before)
        eng.launch(lambda v=v: seen.append((v.cu_seqlens_q.tolist(), v.kv_lens.tolist(), v.page_table.clone())))
    eng.sync()
    assert queued == [6, 6] and eng.waits == 1
    assert seen[0][:2] == ([0, 3, 5, 5], [3, 2, 0]) and seen[1][:2] == ([0, 4, 4, 4], [4, 0, 0])
    assert seen[0][2][:2, :2].tolist() == [[7, 8], [9, 0]] and seen[1][2][0, :3].tolist() == [5, 6, 2]
