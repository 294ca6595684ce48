"""`graphcp tune --measure` captures the tuned buckets with the real runner."""

from graphcp.runtime.capture.buckets import BucketSet
from graphcp.tune.measure import measure_capture


def test_measure_capture_real_runner_cp2():
    rows = measure_capture(BucketSet((16, 32)), 2)
    assert [r["capacity"] for r in rows] == [16, 32]
    for r in rows:
        assert r["capture_s"] > 0
        assert r["breaks"] == 4  # the default model has 4 layers: one attention break each
        assert r["segments"] == 5
        assert r["pool_bytes"] == 0  # the trace backend has no graph pool


def test_tuned_bucket_file_round_trips_into_the_runner(tmp_path):
    """graphcp tune writes the file; graphcp prefill --buckets and the Python API load it."""
    import json

    import numpy as np

    from graphcp import PrefillEngine, Request
    from graphcp.cli.main import main
    from graphcp.config import RuntimeConfig

    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps({"extend": [n]}) for n in (40, 90, 100, 200, 210)) + "\n")
    out = tmp_path / "buckets.json"
    assert main(["tune", "--workload", str(workload), "--cp", "1", "--max-buckets", "2", "--output", str(out),
                 "--baselines", "none"]) == 0
    tuned = BucketSet.load(out)
    assert tuned.cp_size == 1 and tuned.layout == "zigzag" and len(tuned.capacities) <= 2
    eng = PrefillEngine("default", RuntimeConfig(graph="breakable", kv_tokens=2048), None, tuned)
    res = eng.prefill([Request(np.arange(100))])
    assert res.info.path == "graph" and res.info.capacity in tuned.capacities
    # the CLI takes the same file; a file tuned for another CP size is refused
    req = tmp_path / "r.jsonl"
    req.write_text(json.dumps({"tokens": list(range(100))}) + "\n")
    assert main(["prefill", "--input", str(req), "--output", str(tmp_path / "o.pt"), "--buckets", str(out)]) == 0
    assert main(["prefill", "--input", str(req), "--output", str(tmp_path / "o.pt"), "--buckets", str(out),
                 "--cp", "2"]) == 2
