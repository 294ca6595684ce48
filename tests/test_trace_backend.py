"""The trace backend is a strict CPU stand-in for CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from graphcp.dist import launch
from graphcp.runtime.capture.graphs import CaptureError, TraceBackend


def _record(fn):
    seg = TraceBackend().new_segment()
    seg.begin()
    try:
        out = fn()
    finally:
        seg.end()
    return seg, out


def test_python_int_from_live_metadata_is_frozen_at_capture():
    x = torch.arange(8, dtype=torch.float32)
    out = torch.zeros(())
    meta = {"n": 3}  # the live batch's metadata, read as a Python int inside the region

    seg, _ = _record(lambda: out.copy_(x[: meta["n"]].sum()))
    assert out.item() == 0 + 1 + 2
    meta["n"] = 6
    x.mul_(10)
    seg.replay()
    # a CUDA graph would still sum 3 elements: so must the stand-in
    assert out.item() == 10 * (0 + 1 + 2)
    assert out.item() != x[:6].sum().item()


def test_replay_writes_into_the_captured_output_storage():
    x = torch.randn(4, 4)
    seg, y = _record(lambda: torch.relu(x @ x) * 2)
    ptr = y.data_ptr()
    for _ in range(3):
        x.copy_(torch.randn(4, 4))
        seg.replay()
        assert y.data_ptr() == ptr
        assert torch.equal(y, torch.relu(x @ x) * 2)


def test_views_alias_the_same_storage_after_replay():
    x = torch.randn(6, 4)
    seg, (y, v) = _record(lambda: (lambda y: (y, y[2:4].t()))(x + 1))
    x.fill_(5.0)
    seg.replay()
    assert torch.equal(v, (x + 1)[2:4].t())


def test_host_sync_inside_a_segment_is_an_error():
    x = torch.ones(3)
    with pytest.raises(CaptureError, match="reads a tensor value on the host"):
        _record(lambda: int(x.sum()))


def test_data_dependent_shape_inside_a_segment_is_an_error():
    x = torch.tensor([0.0, 1.0, 0.0])
    with pytest.raises(CaptureError, match="data-dependent output shape"):
        _record(lambda: x.nonzero())


def _collective_job(group):
    x = torch.zeros(4, 3)
    seg, (g, r) = _record(lambda: (lambda g: (g, group.reduce_scatter_rows(torch.cat([g, g]) + 1)))(
        group.all_gather_rows(x * 2)))
    ops = [str(op.func) for op in seg._ops]
    results = []
    for step in range(3):
        x.fill_(group.rank + 1 + step)
        seg.replay()
        results.append((g.clone(), r.clone()))
    return ops, results


def test_collectives_inside_a_segment_replay_correctly_at_cp2():
    for rank, (ops, results) in enumerate(launch(_collective_job, 2)):
        assert "c10d._allgather_base_.default" in ops and "c10d._reduce_scatter_base_.default" in ops
        for step, (g, r) in enumerate(results):
            xs = [torch.full((4, 3), float(k + 1 + step)) for k in range(2)]
            want_g = torch.cat([x * 2 for x in xs])
            assert torch.equal(g, want_g)
            full = sum(torch.cat([want_g, want_g]) + 1 for _ in range(2))
            assert torch.equal(r, full[rank * 8 : (rank + 1) * 8])
