"""`graphcp prefill --cp N` writes the same OUT.pt as one rank; `graphcp run`
runs the main job at CP = 2 and checks graph against eager."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cp_utils import rel_err

from graphcp.cli.main import main
from graphcp.runtime.capture.buckets import BucketSet

#: the tiny checkpoint's vocabulary and hidden size (tests/conftest.py TINY)
VOCAB, HIDDEN = 512, 64


@pytest.fixture(scope="module")
def tiny(hf_model_dir):
    """The tiny tied Qwen3 at the default preset's 4 layers (2 KV heads, head_dim 32):
    the commands' code paths at a sixteenth of the preset's work (hidden 64, vocab 512)."""
    return str(hf_model_dir("qwen3", True, num_hidden_layers=4))


@pytest.fixture()
def requests_file(tmp_path):
    rng = np.random.default_rng(3)
    lines = [
        {"tokens": rng.integers(0, VOCAB, 130).tolist(), "prefix": 50},
        {"tokens": rng.integers(0, VOCAB, 3).tolist()},
        {"tokens": [42]},
        {"tokens": rng.integers(0, VOCAB, 77).tolist(), "prefix": 1},
    ]
    p = tmp_path / "req.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return p


#: CP 2 vs one rank: the same math, reduced in another order (and padded rows in bfloat16)
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.mark.parametrize("layout,graph,dtype", [("zigzag", "breakable", "float32"), ("zigzag", "breakable", "bfloat16"),
                                                ("interleave", "off", "float32")])
def test_prefill_cp2_writes_the_same_out_as_one_rank(tmp_path, tiny, requests_file, layout, graph, dtype):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    base = ["prefill", "--model", tiny, "--input", str(requests_file), "--all-logits", "--kv-tokens", "4096",
            "--dtype", dtype]
    assert main(base + ["--output", str(one), "--graph", "off"]) == 0
    assert main(base + ["--output", str(two), "--cp", "2", "--layout", layout, "--graph", graph]) == 0
    a, b = torch.load(one), torch.load(two)
    assert set(a) == set(b) == {"last_logits", "logits"}
    assert a["last_logits"].dtype == torch.float32 and a["last_logits"].shape == (4, VOCAB)
    assert rel_err(b["last_logits"], a["last_logits"]) <= TOL[dtype]
    assert [x.shape[0] for x in b["logits"]] == [80, 3, 1, 76]
    for x, y in zip(b["logits"], a["logits"]):
        assert rel_err(x, y) <= TOL[dtype]


def test_run_main_job_cp2(tmp_path, tiny, capsys):
    buckets = tmp_path / "b.json"
    BucketSet((512, 1536)).save(buckets)  # fewer buckets than the default, to keep CI short
    out = tmp_path / "run.json"
    assert main(["run", "--model", tiny, "--buckets", str(buckets), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["cp_size"] == 2 and res["graph_path"] == "graph"
    assert res["buckets"] == [1536, 512]
    assert res["rel_diff"] <= 1e-5
    # the replay is checked bitwise against the same-bucket body in both dtypes, and
    # every captured bucket passed the self-check
    assert [c["dtype"] for c in res["comparisons"]] == ["float32", "bfloat16"]
    assert all(c["same_bucket_bitwise"] is True and c["path"] == "graph" for c in res["comparisons"])
    assert res["comparisons"][1]["rel_diff"] <= 2e-2
    assert res["verify_s"] > 0 and all(c["verify_s"] > 0 for c in res["captures"])
    # one segment per layer boundary plus one break per layer
    assert res["graph_breaks"] == 4 and res["graph_segments"] == 5
    # (C - 1) x capacity rows of K and V, 2 kv heads x 32 dims, float32
    assert res["kv_bytes_per_layer"] == 1 * 1536 * 2 * 2 * 32 * 4
    table = capsys.readouterr().out
    for row in ("buckets captured", "capture time", "self-check", "eager forward", "graph forward",
                "graph vs eager (float32)", "graph vs eager (bfloat16)"):
        assert row in table


def test_prefill_under_torchrun_matches_one_rank(tmp_path, tiny, requests_file):
    """Each torchrun process is one rank (gloo on CPU); rank 0 writes OUT.pt."""
    import os
    import subprocess
    import sys

    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    base = ["prefill", "--model", tiny, "--input", str(requests_file), "--kv-tokens", "4096"]
    assert main(base + ["--output", str(one), "--graph", "off"]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # --standalone: torchrun binds its rendezvous on a port it picks as it binds
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "graphcp", *base, "--output", str(two), "--cp", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = torch.load(one), torch.load(two)
    assert rel_err(b["last_logits"], a["last_logits"]) <= 1e-5


def test_prefill_pp2_under_torchrun_with_microbatches_and_aux_matches_one_rank(tmp_path, tiny, requests_file):
    """--pp 2 under torchrun (2 processes, stage-major), an uneven --pp-layers split,
    micro-batches and auxiliary layers on both stages: the same OUT.pt as one rank,
    written by global rank 0."""
    import os
    import subprocess
    import sys

    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    base = ["prefill", "--model", tiny, "--input", str(requests_file), "--all-logits", "--kv-tokens", "4096",
            "--aux-hidden-layers", "3,1"]
    assert main(base + ["--output", str(one), "--graph", "off"]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "graphcp", *base, "--output", str(two), "--pp", "2", "--pp-layers", "3,1", "--pp-microbatches", "2"]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "on 2 ranks (2 stages x CP 1)" in proc.stdout
    a, b = torch.load(one), torch.load(two)
    assert set(a) == set(b) == {"last_logits", "logits", "aux_hidden", "aux_hidden_layers"}
    assert b["aux_hidden_layers"] == [3, 1]
    assert [x.shape for x in b["aux_hidden"]] == [(80, 2 * HIDDEN), (3, 2 * HIDDEN), (1, 2 * HIDDEN), (76, 2 * HIDDEN)]
    assert rel_err(b["last_logits"], a["last_logits"]) <= TOL["float32"]
    for key in ("logits", "aux_hidden"):
        for x, y in zip(b[key], a[key]):
            assert rel_err(x, y) <= TOL["float32"], key
