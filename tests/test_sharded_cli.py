"""The sharded cache from the command line, read from the stats file: at C = 4 on a GQA
model with N_H / N_KV = 3 and the default hardware constants, a fresh 4K-token
prompt runs pass-KV and a 64-token extend of its 4K cached prefix pass-Q; a request
of 3x one rank's --kv-tokens is prefilled correctly sharded (each rank storing at
most ceil(tokens / C) plus a page) and refused with a clear error replicated."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from helpers import rel_err

from graphcp.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
PREFIX, NEW, CP, PAGE = 4096, 64, 4, 16
KV_TOKENS = math.ceil((PREFIX + NEW) / 3)  # the request is 3x one rank's pool


def _request(tmp_path: Path, vocab: int) -> tuple[Path, np.ndarray]:
    tokens = np.random.default_rng(0).integers(0, vocab, PREFIX + NEW)
    path = tmp_path / "req.jsonl"
    path.write_text(json.dumps({"tokens": tokens.tolist(), "prefix": PREFIX}) + "\n")
    return path, tokens


def test_sharded_prefill_from_the_command_line(tmp_path, hf_model_dir, hf_model, capsys):
    folder = hf_model_dir("llama", False, "float32", num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                          max_position_embeddings=8192)
    req, tokens = _request(tmp_path, 512)
    common = ["prefill", "--model", str(folder), "--input", str(req), "--dtype", "float32", "--graph", "off",
              "--kv-tokens", str(KV_TOKENS), "--all-logits"]
    # replicated, one rank's pool: refused before any work is written
    capsys.readouterr()  # what building the checkpoint printed
    code = main(common + ["--output", str(tmp_path / "rep.pt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and not (tmp_path / "rep.pt").exists()
    assert "request 0: 4096 tokens exceed the KV pool of 1392" in err[0], err
    # sharded over 4 ranks: the same pool per rank holds it
    stats_path, out_path = tmp_path / "stats.json", tmp_path / "out.pt"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "graphcp", *common, "--output", str(out_path), "--cp", str(CP),
                           "--kv-cache", "sharded", "--stats", str(stats_path)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(stats_path.read_text())["ranks"]
    assert [r["rank"] for r in ranks] == list(range(CP))
    for r in ranks:
        assert r["kv_cache"] == "sharded" and r["kv_pool_tokens"] == 1392 and r["kv_pool_bytes"] > 0
        # each rank stores at most ceil(tokens / C) plus one page of the request
        assert r["kv_stored_tokens"] <= math.ceil((PREFIX + NEW) / CP) + PAGE, r["kv_stored_tokens"]
        fresh, extend = r["forwards"]
        assert (fresh["exchange"], fresh["new_tokens"], fresh["cached_tokens"]) == ("pass-kv", PREFIX, 0)
        assert (extend["exchange"], extend["new_tokens"], extend["cached_tokens"]) == ("pass-q", NEW, PREFIX)
        for f in (fresh, extend):
            assert f["path"] == "eager" and f["bucket"] is None and f["bytes_received"] > 0
            assert f["exchange_choice"]["num_heads"] == 3 * f["exchange_choice"]["num_kv_heads"]
            assert f["exchange_choice"]["peak_tflops"] == 989.0 and f["exchange_choice"]["link_gb_per_s"] == 450.0
    assert sum(r["kv_stored_tokens"] for r in ranks) == PREFIX + NEW
    # and correct: transformers on the whole request
    got = torch.load(out_path)["logits"][0]
    with torch.inference_mode():
        want = hf_model(folder, "float32")(torch.from_numpy(tokens)[None]).logits[0, PREFIX:].float()
    assert rel_err(got, want) <= 1e-4, rel_err(got, want)
