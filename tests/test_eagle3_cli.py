"""``graphcp prefill --draft DIR`` (CP 2, a cached prefix): OUT.pt gains ``draft_logits``
(the draft's logits at each request's last position, as the API returns them) and
``draft_to_target``; the stats file shows no hidden-state exchange and the draft's K/V
bytes per rank; a broken draft is a one-line error with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from eagle3_ref import draft_config, draft_tensors, write_draft, write_target
from helpers import rel_err

import graphcp.cli.commands as cli_commands
from graphcp import PrefillEngine, RuntimeConfig
from graphcp.cli.main import main
from graphcp.dist import launch
from graphcp.runtime.engine import prefill_after_prefixes

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "graphcp", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


def _api(group, target, draft, reqs):
    eng = PrefillEngine(target, RuntimeConfig(kv_tokens=1024, graph="breakable", draft=draft), group)
    return prefill_after_prefixes(eng, [(np.array(t[:p]) if p else None, np.array(t[p:])) for t, p in reqs]).draft


def test_prefill_draft_writes_the_draft_logits_and_map(tmp_path, capsys, monkeypatch):
    target, draft = write_target(tmp_path / "target"), write_draft(tmp_path / "draft")
    rng = np.random.default_rng(2)
    reqs = [(rng.integers(0, 512, 30).tolist(), 12), (rng.integers(0, 512, 7).tolist(), 0)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"tokens": t, "prefix": p}) + "\n" for t, p in reqs))
    out, stats = tmp_path / "out.pt", tmp_path / "stats.json"
    res = _cli("prefill", "--input", str(tmp_path / "r.jsonl"), "--output", str(out), "--model", str(target),
               "--cp", "2", "--kv-tokens", "1024", "--draft", str(draft), "--stats", str(stats), "--no-memory-check")
    assert res.returncode == 0, res.stderr
    got = torch.load(out)
    want = launch(_api, 2, str(target), str(draft), reqs)[0]
    assert got["draft_logits"].dtype == torch.float32 and got["draft_logits"].shape == (2, 128)
    assert rel_err(got["draft_logits"], want.logits) <= 1e-6
    assert got["draft_to_target"].dtype == torch.int64
    assert torch.equal(got["draft_to_target"], torch.arange(128) + draft_tensors()["d2t"])
    ranks = json.loads(stats.read_text())["ranks"]
    last = [r["forwards"][-1] for r in ranks]  # the new tokens' forward (the prefix's came first)
    assert [f["draft_hidden_bytes_received"] for f in last] == [0, 0]
    assert [f["draft_kv_bytes_stored"] for f in last] == [(18 + 7) * 2 * 2 * 16 * 4] * 2  # replicated
    assert all(f["draft_kv_bytes_received"] > 0 for f in last)
    # the refusals through the command's own entry in this process (``python -m graphcp``
    # is ``SystemExit(main())``, run as a process above): exit code 2, one stderr line
    t = draft_tensors()
    del t["norm.weight"]
    bad = write_draft(tmp_path / "bad", t)
    common = ["prefill", "--input", str(tmp_path / "r.jsonl"), "--output", str(out), "--model", str(target),
              "--kv-tokens", "1024", "--no-memory-check"]
    capsys.readouterr()
    assert main([*common, "--draft", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "missing tensor 'norm.weight'" in err
    assert len(err.strip().splitlines()) == 1, err
    # refused before any rank starts: a draft that does not fit the target, pipeline stages
    monkeypatch.setattr(cli_commands, "run_job_on_ranks", lambda *a: pytest.fail("refused before launching"))
    misfit = write_draft(tmp_path / "misfit", config=draft_config(num_key_value_heads=4))
    for flags, message in ((["--draft", str(misfit)], "num_key_value_heads=4, the target model has 2"),
                           (["--draft", str(draft), "--pp", "2"], "--pp >1 with --draft: the draft runs after")):
        assert main([*common, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_the_memory_estimate_counts_the_draft(tmp_path):
    """--memory-check with --draft: the draft's checkpoint among the weights, and its one
    more cache layer in the pool (the target has 4 layers: the pool grows by a quarter)."""
    from graphcp.jobs.memory import job_memory
    from graphcp.jobs.spec import JobSpec

    target, draft = write_target(tmp_path / "target"), write_draft(tmp_path / "draft")
    rt = RuntimeConfig(kv_tokens=4096)
    without, with_draft = (job_memory(JobSpec(str(target), r, cp_size=2), [512])
                           for r in (rt, RuntimeConfig(kv_tokens=4096, draft=str(draft))))
    files = sum(f.stat().st_size for f in Path(draft).glob("*.safetensors"))
    assert files > 0 and with_draft.weights == without.weights + files
    assert with_draft.kv_pool * 4 == without.kv_pool * 5
