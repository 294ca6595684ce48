"""The mesh through the command line: SGLang's example deployment (Qwen3-MoE, attention
TP 2 x CP 2 with EP 4 for the MoE layers: ``--tp 4 --cp 2 --moe ep``) writes the same
OUT.pt as one rank, its stats file gives every rank's (dp, cp, attn_tp) coordinates and
stored KV heads; ``graphcp run --tp 4 --cp 2`` shows the mesh; bad degrees are one-line
errors with exit code 2."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from helpers import rel_err

from graphcp.cli.main import main
from graphcp.runtime.capture.buckets import BucketSet


@pytest.fixture()
def requests_file(tmp_path):
    rng = np.random.default_rng(4)
    lines = [{"tokens": rng.integers(0, 8192, 61).tolist(), "prefix": 20}, {"tokens": rng.integers(0, 8192, 9).tolist()},
             {"tokens": [7]}]
    p = tmp_path / "req.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return p


def test_the_seed_example_qwen3_moe_tp4_cp2_ep4_matches_one_rank(tmp_path, requests_file, capsys):
    one, mesh, stats = tmp_path / "one.pt", tmp_path / "mesh.pt", tmp_path / "stats.json"
    base = ["prefill", "--model", "default-moe", "--input", str(requests_file), "--all-logits", "--kv-tokens", "1024",
            "--aux-hidden-layers", "0,2"]
    assert main(base + ["--output", str(one), "--graph", "off"]) == 0
    assert main(base + ["--output", str(mesh), "--tp", "4", "--cp", "2", "--moe", "ep", "--stats", str(stats)]) == 0
    assert "on ranks 4 = CP 2 x attention TP 2; MLP/MoE TP 4" in capsys.readouterr().out
    a, b = torch.load(one), torch.load(mesh)
    assert rel_err(b["last_logits"], a["last_logits"]) <= 1e-5
    for key in ("logits", "aux_hidden"):
        for x, y in zip(b[key], a[key]):
            assert x.shape == y.shape and rel_err(x, y) <= 1e-5, key
    ranks = json.loads(stats.read_text())["ranks"]
    assert [r["mesh"] for r in ranks] == [{"stage": 0, "dp": 0, "cp": c, "attn_tp": a} for c in (0, 1) for a in (0, 1)]
    assert {r["kv_heads"] for r in ranks} == {1} and {r["attn_tp_size"] for r in ranks} == {2}  # 2 KV heads / 2
    moe = [f for r in ranks for f in r["forwards"] if f.get("moe_layout") == "ep"]
    assert moe and all(f["moe_bytes_received"] > 0 for f in moe)


def test_prefill_with_attention_dp_matches_one_rank(tmp_path, requests_file, capsys):
    """--tp 4 --cp 2 --dp 2: two replicas of CP 2, the requests split between them."""
    one, dp = tmp_path / "one.pt", tmp_path / "dp.pt"
    base = ["prefill", "--model", "default", "--input", str(requests_file), "--all-logits", "--kv-tokens", "1024"]
    assert main(base + ["--output", str(one), "--graph", "off"]) == 0
    assert main(base + ["--output", str(dp), "--tp", "4", "--cp", "2", "--dp", "2"]) == 0
    assert "on ranks 4 = DP 2 x CP 2 x attention TP 1; MLP/MoE TP 4" in capsys.readouterr().out
    a, b = torch.load(one), torch.load(dp)
    assert rel_err(b["last_logits"], a["last_logits"]) <= 1e-5
    for x, y in zip(b["logits"], a["logits"]):
        assert x.shape == y.shape and rel_err(x, y) <= 1e-5


def test_run_shows_the_mesh(tmp_path, hf_model_dir, capsys):
    buckets = tmp_path / "b.json"
    BucketSet((2048,)).save(buckets)
    out = tmp_path / "run.json"
    assert main(["run", "--model", str(hf_model_dir("qwen3")), "--tp", "4", "--cp", "2", "--buckets", str(buckets),
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["tp_size"], res["cp_size"], res["graph_path"]) == (4, 2, "graph")
    assert all(c["same_bucket_bitwise"] is True for c in res["comparisons"])  # float32 and bfloat16
    assert res["rel_diff"] <= 1e-5
    # (C - 1) x capacity rows of K and V of the rank's 1 KV head (of 2) x 32 dims, float32
    assert res["kv_bytes_per_layer"] == res["bytes_received_per_layer"] == 1 * 2048 * 2 * 1 * 32 * 4
    assert re.search(r"\| ranks \(mesh\) +\| 4 = CP 2 x attention TP 2; MLP/MoE TP 4 \|", capsys.readouterr().out)


@pytest.mark.parametrize("flags,msg", [
    (["--tp", "3", "--cp", "2"], "--tp 3 must be a multiple of --dp x --cp = 1 x 2 = 2"),
    (["--tp", "16"], "num_attention_heads=8 does not divide by attention TP 16"),
    (["--model", "default-dsa", "--tp", "2"], "a DSA (MLA) model runs attention TP 1 under CP"),
])
def test_bad_mesh_flags_are_one_line(tmp_path, capsys, flags, msg):
    req = tmp_path / "r.jsonl"
    req.write_text('{"tokens": [1, 2, 3]}\n')
    flags = [str(tmp_path / f) if f == "KV" else f for f in flags]
    code = main(["prefill", "--input", str(req), "--output", str(tmp_path / "o.pt"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and msg in err and "error:" in err, err
    assert not (tmp_path / "o.pt").exists()


def test_pd_demo_bad_decode_shape_is_one_line(capsys):
    """(The export under attention DP is built: pd-demo's prefill side takes --dp; its
    decode side's shape is checked as the flags are read.)"""
    with pytest.raises(SystemExit) as e:  # (argparse's: the flag's type)
        main(["pd-demo", "--decode-cp", "0", "--transport", "file"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--decode-cp" in err, err
