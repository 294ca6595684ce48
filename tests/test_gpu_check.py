"""scripts/gpu_check.py: the one-shot GPU check, exercised end to end on the CPU
with ``--dry-run`` (torch backend, triton under the interpreter when installed,
tiny sizes, trace graphs)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _load():
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = mod  # dataclasses look their module up while the class is built
        spec.loader.exec_module(mod)
    return sys.modules["gpu_check"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run in a subprocess (it sets TRITON_INTERPRET for itself)."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    out = tmp / "res" / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--profiles-dir", str(tmp / "profiles")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, out, proc


def test_dry_run_backend_checks(dry_run):
    _, out, _ = dry_run
    res = json.loads(out.read_text())
    assert res["schema"] == 1 and res["dry_run"] is True
    assert res["device"]["type"] == "cpu"
    checks = res["backends"]["checks"]
    assert {c["backend"] for c in checks} == set(res["backends"]["checked"]) >= {"torch"}
    for c in checks:
        assert c["status"] == "pass", c
        assert c["plans"] >= 3
        assert max(c["max_rel_err_out"], c["max_rel_err_out_nolse"], c["max_rel_err_lse"]) <= c["tol"]
        assert c["padding_untouched"] is True
    seen = {(c["backend"], c["dtype"], c["head_dim"]) for c in checks}
    assert {("torch", d, h) for d in ("float32", "bfloat16") for h in (64, 128)} <= seen
    assert all(c["num_q_heads"] > c["num_kv_heads"] for c in checks)  # GQA


def test_dry_run_timing_launches_captures(dry_run):
    _, out, _ = dry_run
    res = json.loads(out.read_text())
    rows = {(r["backend"], r["path"], r["tokens"]): r for r in res["timing"] if r["model"] == "default"}
    for n in (64, 256):
        eager, graph = rows[("torch", "eager", n)], rows[("torch", "breakable", n)]
        for r in (eager, graph):
            assert r["status"] == "ok", r
            assert r["median_ms"] > 0 and r["repeats"] >= 1 and len(r["times_ms"]) == r["repeats"]
        assert eager["ran"] == "eager"
        assert graph["ran"] == "graph" and graph["bucket"] == n
        assert graph["segments"] == graph["breaks"] + 1 == 5  # 4 layers: one attention break each
        assert graph["logits_rel_diff_vs_eager"] <= 1e-5
        assert rows[("torch", "full", n)]["status"] == "skipped"  # torch attention has no full-graph mode
    launches = {r["path"]: r for r in res["launches"] if r["backend"] == "torch"}
    assert launches["eager"]["status"] == launches["breakable"]["status"] == "ok"
    assert launches["breakable"]["host_ops"] < launches["eager"]["host_ops"]
    assert launches["eager"]["profiled_cpu_ops"] > 0
    caps = {c["capacity"]: c for c in res["captures"] if c["backend"] == "torch"}
    assert set(caps) == {64, 256}
    assert all(c["capture_s"] > 0 and c["breaks"] == 4 for c in caps.values())


def test_dry_run_markdown_printed_last_and_written(dry_run):
    tmp, out, proc = dry_run
    md = out.with_suffix(".md").read_text()
    assert proc.stdout.rstrip().endswith(md.rstrip())
    assert md.index("## Attention backends") < md.index("## Prefill time")
    last = proc.stdout.rstrip().splitlines()[-1]
    assert last.startswith("| default | torch | 256 | full |")  # the timing table ends the output
    prof = tmp / "profiles" / "cpu-dry-run"
    assert (prof / "gpu_check.md").read_text() == md
    assert json.loads((prof / "gpu_check.json").read_text())["dry_run"] is True


def test_budget_guard_skips_instead_of_running(tmp_path, capsys):
    gc = _load()
    out = tmp_path / "gpu_check.json"
    assert gc.main(["--dry-run", "--no-triton", "--budget-s", "0", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["backends"]["checks"] and all(c["status"] == "skipped" for c in res["backends"]["checks"])
    assert res["timing"] and all(r["status"] == "skipped" for r in res["timing"])
    assert capsys.readouterr().out == out.with_suffix(".md").read_text()


def test_trace_counts_cuda_events():
    """The CUDA side of the launch count, on a synthetic profiler trace."""
    gc = _load()
    ev = [
        {"ph": "X", "cat": "kernel", "name": "gemm"},
        {"ph": "X", "cat": "kernel", "name": "attn"},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel"},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx"},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch"},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD"},
        {"ph": "i", "cat": "kernel", "name": "marker"},
    ]
    assert gc.trace_counts(ev, cuda=True) == {
        "kernels": 2, "kernel_launch_calls": 2, "graph_launches": 1, "memcpy": 1, "memset": 0,
    }
