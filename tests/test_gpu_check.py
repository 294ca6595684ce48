"""``graphcp gpu-check`` (graphcp/gpucheck/; ``scripts/gpu_check.py`` wraps it), the
one-shot GPU check, exercised end to end on the CPU with ``--dry-run`` (torch
backend, triton under the interpreter, tiny sizes, trace graphs), through the
documented wrapper, with the packages the device image lacks hidden. Nothing here
depends on the machine's speed: the dry run gets a budget that cannot run out, and the
budgeting is tested with a fake clock."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphcp.cli.main import build_parser, main
from graphcp.gpucheck import budget as budget_mod
from graphcp.gpucheck.launches import range_counts, trace_counts
from graphcp.gpucheck.settings import (
    BUDGET_S,
    FULL_PHASES,
    PHASES,
    PLANNED_LIMIT_S,
    default_budget_s,
    planned_s,
    settings_from_args,
)

ROOT = Path(__file__).resolve().parents[1]
#: what the GPU machine's image does not have (nvtx, flashinfer) and what the check must not
#: need besides (it has transformers 5.17; the check runs without it): nothing it imports may
ABSENT_ON_DEVICE = ("nvtx", "flashinfer", "transformers", "hypothesis", "matplotlib")
#: a budget that cannot run out on a loaded machine: the shares scale with it
NO_LIMIT = "1000000"
HIDE = "import sys; sys.modules.update(dict.fromkeys({!r})); ".format(ABSENT_ON_DEVICE)
WRAPPER = HIDE + ("import runpy; sys.argv = ['scripts/gpu_check.py'] + sys.argv[1:]; "
                  "runpy.run_path('scripts/gpu_check.py', run_name='__main__')")
PYTHON_M = HIDE + "import runpy; sys.argv = ['graphcp'] + sys.argv[1:]; runpy.run_module('graphcp', run_name='__main__')"


def _device_like(program: str, *args: str) -> subprocess.CompletedProcess:
    """``program`` in a fresh interpreter at the repository root, graphcp from this
    tree on PYTHONPATH (as on the device: nothing installed)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", program, *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run through the wrapper in a subprocess (it sets TRITON_INTERPRET for itself)."""
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    proc = _device_like(WRAPPER, "--dry-run", "--out", str(out), "--budget-s", NO_LIMIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "gpu_check.json").read_text()), proc


def test_dry_run_environment_and_notes(dry_run):
    _, res, _ = dry_run
    assert res["schema"] == 3 and res["dry_run"] is True and res["device"]["type"] == "cpu"
    assert res["env"]["nvtx"] is False and any("nvtx" in n for n in res["notes"])
    assert any(n.startswith("flashinfer is not installed: the flashinfer and trtllm attention backends were not "
                            "checked") for n in res["notes"])
    assert not any("64 MiB" in n or "device machine" in n for n in res["notes"])  # no words about one lab's setup
    used, shares = res["phases"]["used"], res["phases"]["shares"]
    assert set(used) == set(shares) == set(PHASES)
    # every phase ran and was timed; whether it kept to its share is the budget's own test
    # (test_budget_shares_carry_over, a fake clock): a wall-clock bound here fails under load
    assert all(used[p] > 0 for p in used) and sum(shares.values()) <= res["budget_s"]
    assert res["errors"] == [] and res["failures"] == [] and res["failed_parts"] == [] and res["not_run"] == []


def test_dry_run_triton_warmup_and_kernel_checks(dry_run):
    _, res, _ = dry_run
    w = res["triton_warmup"]
    assert w["status"] == "ok" and w["launched"] == w["variants"] >= 8 and w["compiles"] is None  # interpreted
    checks = res["backends"]["checks"]
    assert {c["backend"] for c in checks} == {"torch", "triton"}
    for c in checks:
        assert c["status"] == "pass", c
        assert c["plans"] >= 3
        assert max(c["max_rel_err_out"], c["max_rel_err_out_nolse"], c["max_rel_err_lse"]) <= c["tol"]
        assert c["padding_untouched"] is True
    seen = {(c["backend"], c["dtype"], c["head_dim"]) for c in checks}
    assert {(b, d, h) for b in ("torch", "triton") for d in ("float32", "bfloat16") for h in (64, 128)} == seen
    assert all(c["num_q_heads"] > c["num_kv_heads"] for c in checks)  # GQA


def test_dry_run_sparse_mla_and_moe_graph(dry_run):
    """The DSA kernel part (interpreted, tiny) against the float32 absorbed attention, both
    dtypes, every row checked; the MoE part: trace-captured layer, routing changing at
    every replay, replays equal eager bitwise and the per-expert loop."""
    _, res, _ = dry_run
    sparse = {r["dtype"]: r for r in res["sparse_mla"]}
    assert set(sparse) == {"float32", "bfloat16"}
    for r in sparse.values():
        assert r["status"] == "pass" and r["max_rel_err"] <= r["tol"] and r["empty_rows_zero"], r
        assert r["checked_rows"] == r["rows"] == 40 and r["last_row_checked"] == 39
    (moe,) = res["moe_graph"]
    assert moe["status"] == "pass" and moe["graph_backend"] == "trace" and moe["routing_changed"], moe
    assert moe["bitwise_equal"] and moe["max_rel_err_vs_loop"] <= moe["tol"] and moe["replays"] == 3


def test_gpu_default_sparse_part_is_past_int32():
    """On a GPU the sparse part's q_lat has more than 2**31 elements (DeepSeek V3.2's heads
    and latent), where a 32-bit row or head offset wraps."""
    st = settings_from_args(build_parser().parse_args(["gpu-check"]))
    rows, heads, lora, _ = st.sparse_shape
    assert heads == 128 and lora == 512 and rows * heads * lora >= 2**31 and st.moe_dtypes == ("bfloat16",)


def test_a_part_that_errors_makes_the_command_fail_and_names_it(tmp_path, monkeypatch, capsys):
    """A part that raises, and a part whose row fails, each named; exit code 1 (it was 0
    whatever the parts logged, e.g. every Triton part under Triton 3.6's interpreter)."""
    from graphcp.gpucheck import moe_graph, sparse_mla

    def boom(*a, **k):
        raise RuntimeError("InterpreterError: only 0-dimensional arrays can be converted to Python scalars")

    monkeypatch.setattr(sparse_mla, "check_sparse_mla", boom)
    monkeypatch.setattr(moe_graph, "check_moe_graph",
                        lambda st, budget: [{"dtype": "float32", "graph_backend": "trace", "status": "fail",
                                             "error": "replay differs"}])
    code = main(["gpu-check", "--dry-run", "--budget-s", NO_LIMIT, "--out", str(tmp_path),
                 "--skip", "warmup,kernels,graphs,engines,host,timing,launches"])
    err = capsys.readouterr().err
    assert code == 1
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["failures"] == ["sparse_mla: raised (see errors)", "moe_graph: float32 trace fail (replay differs)"]
    assert "FAILED: 2 check(s) failed, errored or did not run: sparse_mla: raised" in err
    assert "## Failed" in (tmp_path / "gpu_check.md").read_text()


def test_dry_run_graph_replays_bitwise(dry_run):
    _, res, _ = dry_run
    rows = {(g["dtype"], g["graph"]): g for g in res["graphs"]}
    assert set(rows) == {("float32", "breakable"), ("float32", "full")}
    assert rows[("float32", "full")]["attention"] == "triton"  # the interpreted kernel inside the graph
    for g in rows.values():
        assert g["status"] == "pass", g
        assert g["self_check"] in ("passed", "not in this graphcp")
        assert len(g["batches"]) == 2  # a three-request batch and a cached-prefix extension
        for b in g["batches"]:
            assert b["bitwise_equal"] is True and b["max_abs_diff"] == 0.0 and b["bucket"] == 48
            assert b["rel_diff_vs_unpadded_eager"] <= 1e-5
    assert rows[("float32", "full")]["segments_breaks"] == {"48": [1, 0]}
    assert rows[("float32", "breakable")]["segments_breaks"] == {"48": [5, 4]}


def test_dry_run_timing_launches_traces(dry_run):
    out, res, _ = dry_run
    rows = {(r["backend"], r["path"], r["tokens"]): r for r in res["timing"] if r["model"] == "default"}
    for n in (32, 96):
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
    assert launches["breakable"]["ranges"]["segment"] == 5 and launches["breakable"]["ranges"]["attention"] == 4
    assert launches["eager"]["ranges"]["layer"] == 4 and "replay" not in launches["eager"]["ranges"]
    for path in ("eager", "breakable"):
        trace = json.loads(gzip.decompress((out / launches[path]["trace"]).read_bytes()))
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "graphcp:prefill" in names and ("graphcp:replay[32]" in names) == (path == "breakable")
    caps = {c["capacity"]: c for c in res["captures"] if c["backend"] == "torch"}
    assert set(caps) == {32, 96}
    assert all(c["capture_s"] > 0 and c["breaks"] == 4 for c in caps.values())


def test_dry_run_markdown_printed_last_and_written(dry_run):
    out, _, proc = dry_run
    md = (out / "gpu_check.md").read_text()
    assert proc.stdout.rstrip().endswith(md.rstrip())
    order = ["**Passed**", "## Parts", "## Triton warm-up", "## Attention kernels", "## Graph replay", "## Engines",
             "## Linear-attention hybrid", "## Host preparation", "## Launches", "## Not covered on one GPU", "## Prefill time"]
    assert [md.index(h) for h in order] == sorted(md.index(h) for h in order)
    last = proc.stdout.rstrip().splitlines()[-1]
    assert last.startswith("| default | torch | 96 | full |")  # the timing table ends the output


def test_out_defaults_to_env_out_else_graphcps_cache(monkeypatch, tmp_path):
    """``$OUT`` on the device; elsewhere graphcp's cache, never the current folder (a dry
    run from a checkout left gpu_check_results/ in it)."""
    monkeypatch.setenv("OUT", str(tmp_path / "device-out"))
    assert build_parser().parse_args(["gpu-check"]).out == str(tmp_path / "device-out")
    monkeypatch.delenv("OUT")
    monkeypatch.setenv("GRAPHCP_CACHE", str(tmp_path / "cache"))
    out = Path(build_parser().parse_args(["gpu-check", "--dry-run"]).out)
    assert out == tmp_path / "cache" / "gpu_check" and out.is_absolute()


def test_rows_the_budget_leaves_out_fail_the_run(tmp_path, capsys):
    """A budget of 0: every part's rows are skipped for time instead of running, and the
    run fails naming them (it exited 0 with nothing checked)."""
    assert main(["gpu-check", "--dry-run", "--no-triton", "--budget-s", "0", "--out", str(tmp_path)]) == 1
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["backends"]["checks"] and all(c["status"] == "skipped" for c in res["backends"]["checks"])
    assert res["timing"] and all(r["status"] == "skipped" for r in res["timing"])
    assert res["engines"] and all(r["status"] == "skipped" for r in res["engines"])
    assert res["hybrid"] and all(r["status"] == "skipped" for r in res["hybrid"])
    assert "graphs: skipped, the triton backend is not available" in res["errors"]  # --no-triton: chosen
    assert "kernels: torch float32 2/1x64 did not run (time budget)" in res["failures"]
    assert "timing: default torch eager 32 did not run (time budget)" in res["failures"]
    assert res["options"]["budget_s"] == 0.0 and res["options"]["no_triton"] is True
    out = capsys.readouterr()
    assert out.out == (tmp_path / "gpu_check.md").read_text() and "**FAILED**" in out.out
    assert "FAILED:" in out.err


@pytest.mark.parametrize("flags,expected", [
    (["--sizes", "1k"], "--sizes: expected comma-separated int values, got '1k'"),
    (["--skip", "timing,graph"], "--skip: expected one or more of warmup, kernels, sparse_mla, graphs, engines, hybrid, host, timing, launches, "
                                  "moe_graph"),
    (["--backends", "flash"], "--backends: expected one or more of torch, triton, flashinfer, trtllm"),
    (["--models", "llama-70b"], "--models: expected one or more of default, qwen3-1b-like"),
    (["--repeats", "0"], "--repeats: expected int >= 1, got '0'"),
])
def test_bad_flags_exit_2_with_one_line(flags, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["gpu-check", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and expected in err and len(err.strip().splitlines()) == 1, err


def test_budget_shares_carry_over():
    """A fake clock: the shares fill the total less the reserve (scaled), a part may use
    what earlier parts left, nothing starts past the total."""
    now = [100.0]
    b = budget_mod.Budget(35.0, {"a": 10.0, "b": 20.0}, reserve_s=5.0, clock=lambda: now[0])
    assert b.phases == {"a": 10.0, "b": 20.0}
    b.start("a")
    assert b.remaining() == 10.0
    now[0] += 4.0  # a finishes early: its 6 s pass to b
    b.start("b")
    assert b.used == {"a": 4.0} and b.remaining() == 26.0
    now[0] += 27.0
    assert not b.allows(0.0)  # b's share (and the carry) is spent
    b.start("c")  # a part without a share gets what earlier parts left: nothing
    assert b.remaining() <= 0.0
    b.stop()
    assert b.used == {"a": 4.0, "b": 27.0, "c": 0.0}
    big = budget_mod.Budget(3005.0, {"a": 10.0, "b": 20.0}, reserve_s=5.0, clock=lambda: now[0])
    assert big.phases == {"a": 1000.0, "b": 2000.0}  # a larger budget: larger shares


def test_trace_counts_cuda_events_and_ranges():
    """The CUDA side of the launch count and the graphcp ranges, on a synthetic trace."""
    ev = [
        {"ph": "X", "cat": "kernel", "name": "gemm"},
        {"ph": "X", "cat": "kernel", "name": "attn"},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel"},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx"},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch"},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD"},
        {"ph": "i", "cat": "kernel", "name": "marker"},
        {"ph": "X", "cat": "user_annotation", "name": "graphcp:attention[3]"},
        {"ph": "X", "cat": "user_annotation", "name": "graphcp:attention[0]"},
        {"ph": "X", "cat": "user_annotation", "name": "graphcp:replay[256]"},
    ]
    assert trace_counts(ev, cuda=True) == {
        "kernels": 2, "kernel_launch_calls": 2, "graph_launches": 1, "memcpy": 1, "memset": 0,
    }
    assert range_counts(ev) == {"attention": 2, "replay": 1}


def test_python_m_graphcp_without_cuda_exits_2_and_says_so(tmp_path):
    """``python -m graphcp gpu-check`` from the tree, the device's missing packages hidden:
    it imports, and with no CUDA device refuses in one line (exit 2), writing nothing."""
    proc = _device_like(PYTHON_M, "gpu-check", "--out", str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == ("graphcp gpu-check: error: no CUDA device here; run with --dry-run to exercise "
                                   "the flow on the CPU")
    assert not (tmp_path / "gpu_check.json").exists()


def test_gpu_settings_fit_the_lent_machine():
    """The default GPU run plans for at most 200 s on the lent machine, start-up included
    (its lease keeps room for a rerun): both dtypes where they are checked, the smaller
    sizes, the default model, Triton timed. ``--full`` is the long run."""
    st = settings_from_args(build_parser().parse_args(["gpu-check"]))
    assert st.device == "cuda" and st.graph_backend == "cuda" and not st.full
    assert set(st.check_dtypes) == set(st.graph_dtypes) == {"float32", "bfloat16"}
    assert st.graph_attention == {"breakable": "triton", "full": "triton"}
    assert st.sizes == (1024, 8192) and st.timing_backends == ("triton",) and st.models == ("default",)
    assert default_budget_s(st) == BUDGET_S == sum(PHASES.values()) + 10.0
    assert planned_s(default_budget_s(st)) <= PLANNED_LIMIT_S == 200.0
    full = settings_from_args(build_parser().parse_args(["gpu-check", "--full"]))
    assert full.full and full.sizes == (1024, 8192, 32768) and full.models == ("default", "qwen3-1b-like")
    assert full.phases == FULL_PHASES and default_budget_s(full) > PLANNED_LIMIT_S


def test_doc_gives_the_device_commands_and_the_part_budgets():
    """docs/gpu_check.md: the one-line device commands (the wrapper and ``python -m
    graphcp``) parse with the check's own parser; its figures are the check's (the plan,
    the budgets, a limit that holds the plan, each part's share); its table of what one
    GPU cannot check is the report's."""
    import re
    import shlex

    from graphcp.gpucheck.coverage import MULTI_GPU
    from graphcp.gpucheck.settings import FULL_BUDGET_S, STARTUP_S

    doc = (ROOT / "docs" / "gpu_check.md").read_text()
    for cmd, skip in (('PYTHONPATH=. python scripts/gpu_check.py --out "$OUT"', 3),
                      ('PYTHONPATH=. python -m graphcp gpu-check --out "$OUT"', 5)):
        assert f"```sh\n{cmd}\n```" in doc
        args = build_parser().parse_args(["gpu-check", *shlex.split(cmd)[skip:]])
        assert args.out == "$OUT" and not args.dry_run
    shares = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| `(\w+)` \| (\d+) \|", doc, re.M)}
    assert shares == PHASES
    limit = int(re.search(r"^\| the command's limit \| `timeout_s=(\d+)` \|", doc, re.M).group(1))
    assert planned_s(BUDGET_S) < limit <= 240
    assert (f"| what it plans for | {planned_s(BUDGET_S):.0f} s: ~{STARTUP_S:.0f} s start-up, a {BUDGET_S:.0f} s "
            f"budget ({sum(PHASES.values()):.0f} s of parts, 10 s for the report) |") in doc
    assert f"({FULL_BUDGET_S:.0f} s budget; `timeout_s=540`)" in doc and FULL_BUDGET_S + STARTUP_S < 540
    table = re.findall(r"^\| [^|]+ \| (\d) \| `(graphcp [^`]+)` \|$", doc, re.M)
    assert table == [(str(n), cmd) for _, n, cmd in MULTI_GPU]


def test_dry_run_engines_and_host_preparation(dry_run):
    """DeepSeek V4, MoE tp and ep, an EAGLE-3 draft's breakable and full graphs, and decode
    at CP 1: each replay bitwise equal to the same bucket run eagerly, the prefill (each
    decode step) on the graph, its logits within the bound of the eager path's; the host preparation timed, saying
    which host kernels ran."""
    _, res, _ = dry_run
    rows = {(r["engine"], r["graph"]): r for r in res["engines"]}
    assert set(rows) == {("default-v4", "breakable"), ("default-moe tp", "breakable"),
                         ("default-moe ep", "breakable"), ("default + EAGLE-3 draft", "breakable"),
                         ("default + EAGLE-3 draft", "full"), ("default decode", "breakable")}
    for r in rows.values():
        assert r["status"] == "pass" and r["ran"] == "graph", r
        assert [b["bitwise_equal"] for b in r["batches"]] == [True]
        assert r["logits_rel_diff_vs_eager"] <= r["tol"] == 1e-5
    # 4 layers: an attention and an expert-parallel break each
    assert rows[("default-v4", "breakable")]["segments_breaks"] == {"32": [9, 8]}
    assert rows[("default-moe ep", "breakable")]["experts_in_break"] is True
    assert rows[("default-moe tp", "breakable")]["experts_in_break"] is False  # a CPU captures them
    decode = rows[("default decode", "breakable")]  # 3 requests: bucket 4, a dense step one launch
    assert decode["batches"][0]["bucket"] == [4] and decode["launches_per_step"] == 1
    assert decode["graph_step_ms"] > 0 and decode["eager_step_ms"] > 0
    host = {r["case"]: r for r in res["host"]}
    assert set(host) == {"16 requests, 64..512 tokens", "16 requests, 1..2000 tokens"}
    for r in host.values():
        assert r["status"] == "ok" and r["median_us"] > 0 and r["repeats"] == 20 and r["target_us"] == 50.0
        assert r["host_kernels"] == "compiled (numba)" and (r["cp"], r["rank"], r["requests"]) == (8, 3, 16)


def test_dry_run_hybrid(dry_run):
    """default-hybrid at CP 1, float32 then bfloat16, on the torch kernels here: each replay
    bitwise equal to the same bucket run eagerly (a linear layer is a break), the prefill
    on the graph, the varlen batch run and its distances recorded."""
    _, res, _ = dry_run
    rows = {r["dtype"]: r for r in res["hybrid"] if r["engine"] == "default-hybrid"}
    assert set(rows) == {"float32", "bfloat16"}
    for r in rows.values():
        assert r["status"] == "pass" and r["ran"] == "graph" and r["linear_kernels"] == "torch", r
        assert [b["bitwise_equal"] for b in r["batches"]] == [True] and r["segments_breaks"] == {"32": [9, 8]}
        assert r["logits_rel_diff_vs_eager"] <= r["tol"] and r["varlen_batch"] == "70 + 3 x 5 tokens"
    assert rows["float32"]["kernels_rel_diff_vs_torch"] == 0.0  # the same kernels
    bf16 = rows["bfloat16"]
    assert 0 < bf16["torch_rel_diff_vs_float32"] == bf16["kernels_rel_diff_vs_float32"] < 0.1
    # decode: its steps on the graph (the linear layers' steps inside: one launch), the first
    # replay self-checked, the eager steps within the bound, on the torch step kernels here
    decode = next(r for r in res["hybrid"] if r["engine"] == "default-hybrid decode")
    assert decode["status"] == "pass" and decode["ran"] == "graph" and decode["step_kernels"] == "torch", decode
    assert decode["batches"][0]["bitwise_equal"] and decode["launches_per_step"] == 1


def _report(**rows) -> dict:
    res = {"backends": {"checks": []}, "failed_parts": [], "not_run": [], "triton_warmup": None}
    res.update(rows)
    return res


def test_what_fails_a_run():
    """Rows that failed, errored or ran eagerly where a graph was asked, rows the budget left
    out, parts that did not run; not rows the machine cannot run (a backend that takes no
    such dtype, torch attention in a full graph)."""
    from graphcp.gpucheck.report import failures

    timing = [{"model": "m", "backend": "triton", "path": p, "tokens": 8, "status": s, "error": e}
              for p, s, e in (("eager", "ok", None), ("breakable", "fallback", "ran eagerly: padding_over_factor"),
                              ("full", "skipped", "time budget"), ("full", "fail", "logits differ"))]
    kernels = [{"backend": "flashinfer", "dtype": "float32", "num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64,
                "status": "skipped", "error": "flashinfer does not take float32"}]
    res = _report(timing=timing, not_run=[("graphs", "the triton backend is not available")],
                  triton_warmup={"status": "error: CompilationError: ..."})
    res["backends"]["checks"] = kernels
    assert failures(res) == [
        "graphs: did not run (the triton backend is not available)", "warmup: error: CompilationError: ...",
        "timing: m triton breakable 8 fallback (ran eagerly: padding_over_factor)",
        "timing: m triton full 8 did not run (time budget)", "timing: m triton full 8 fail (logits differ)"]
    assert failures(_report(timing=timing[:1], triton_warmup={"status": "skipped: time budget"})) == []


def test_graph_logits_are_judged_and_batches_that_ran_eagerly_fail():
    """A timing row's logits beyond the bound graphcp run and the CPU tests use fail it (any
    completion passed); a graph batch that ran eagerly fails its row (it passed)."""
    import torch

    from graphcp.gpucheck.graphs import judge_batches
    from graphcp.gpucheck.timing import judge_logits

    eager = torch.ones(4, 8)
    for dtype, off, status in (("float32", 1e-6, "ok"), ("float32", 1e-4, "fail"), ("bfloat16", 1e-3, "ok"),
                               ("bfloat16", 5e-2, "fail")):
        r = {"status": "ok"}
        judge_logits(r, eager + off, eager, dtype)
        assert r["status"] == status and r["tol"] == {"float32": 1e-5, "bfloat16": 2e-2}[dtype], (dtype, off, r)
    for statuses, want in ((["pass", "pass"], "pass"), (["pass", "fallback"], "fail"), (["pass", "skipped"], "skipped"),
                           (["error", "pass"], "error"), (["fail", "pass"], "fail")):
        row = {"batches": [{"batch": str(i), "status": s, "error": None} for i, s in enumerate(statuses)]}
        judge_batches(row)
        assert row["status"] == want, (statuses, row)


@pytest.mark.parametrize("what,gpus,command", __import__("graphcp.gpucheck.coverage", fromlist=["MULTI_GPU"]).MULTI_GPU)
def test_the_multi_gpu_commands_pass_the_up_front_checks(what, gpus, command):
    """Each command the report gives for a row one GPU cannot cover parses and passes every
    check made before ranks start (on the CPU here: --device cpu), with ``gpus`` ranks."""
    import shlex

    from graphcp.jobs.preflight import job_spec, preflight

    argv = shlex.split(command)
    assert argv[0] == "graphcp" and "--device" in argv and argv[argv.index("--device") + 1] == "cuda"
    argv[argv.index("--device") + 1] = "cpu"
    args = build_parser().parse_args(argv[1:])
    spec = job_spec(args)
    preflight(spec)
    assert spec.parallel.world_size == gpus
