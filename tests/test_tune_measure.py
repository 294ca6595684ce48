"""`graphcp tune --measure` captures the tuned buckets with the real runner."""

from graphcp.capture.buckets import BucketSet
from graphcp.tune.measure import measure_capture


def test_measure_capture_real_runner_cp2():
    rows = measure_capture(BucketSet((16, 32)), 2)
    assert [r["capacity"] for r in rows] == [16, 32]
    for r in rows:
        assert r["capture_s"] > 0
        assert r["breaks"] == 4  # the default model has 4 layers: one attention break each
        assert r["segments"] == 5
        assert r["pool_bytes"] == 0  # the trace backend has no graph pool
