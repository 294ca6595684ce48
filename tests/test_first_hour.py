"""A new user's first hour (issue 31): what following the README on a fresh machine ran
into, one test (or group) per item of the issue, numbered as there. Item 3 (pd-demo's
default transport) is in tests/test_pd_cli.py, item 9 (the docs' flags) in
tests/test_docs_flags.py, item 2's message for many failing ranks in
tests/test_dist_failures.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphcp.cli.commands as cli_commands
import graphcp.jobs.memory as memory
from graphcp.attention.base import AttentionSpec
from graphcp.attention.registry import make_attention
from graphcp.cli.main import main
from graphcp.config import RuntimeConfig
from graphcp.dist import CPGroup
from graphcp.errors import ConfigError
from graphcp.jobs.memory import check_local_ranks_fit, estimate_rank_memory
from graphcp.jobs.spec import JobSpec, make_engine

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512  # the tiny checkpoints of conftest.py


@pytest.fixture(scope="module")
def model_dir(hf_model_dir) -> Path:
    return hf_model_dir("qwen3", False, "float32")


def one_line_error(capsys, argv, cmd="prefill", match=None) -> str:
    capsys.readouterr()  # what came before (a fixture's progress bars)
    try:
        got = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors
        got = e.code
    err = capsys.readouterr().err
    assert got == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"graphcp {cmd}: error: ") and "Traceback" not in err, err
    if match is not None:
        assert re.search(match, err), err
    return err


def _requests(tmp_path: Path, lines: list) -> Path:
    p = tmp_path / "req.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


# ---- 1: --attention triton on a CPU ----------------------------------------------------------
def test_item1_triton_on_cpu_runs_the_interpreter_and_says_so_once(tmp_path, model_dir):
    """A fresh shell has no TRITON_INTERPRET: the command sets it before any rank imports
    triton, says so in one stderr line, and the prefill runs (it ended in Triton's
    30-line '0 active drivers' traceback)."""
    req = _requests(tmp_path, [{"tokens": [1, 5, 9, 200, 7]}])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "graphcp", "prefill", "--model", str(model_dir), "--input", str(req),
                        "--output", str(tmp_path / "o.pt"), "--attention", "triton", "--cp", "2", "--graph", "off",
                        "--kv-tokens", "256"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.splitlines() == ["graphcp prefill: note: --attention triton on a CPU runs Triton's interpreter "
                                     "(TRITON_INTERPRET=1 set): exact, but slow"], p.stderr
    assert torch.load(tmp_path / "o.pt")["last_logits"].shape == (1, VOCAB)


def test_item1_the_library_refuses_triton_on_cpu_without_the_interpreter_in_one_line(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spec = AttentionSpec(4, 2, 64, 16, 0.125, "NHD")
    with pytest.raises(ValueError, match=r"^on a CPU Triton runs kernels only in its interpreter: set "
                                         r"TRITON_INTERPRET=1 before triton is imported"):
        make_attention("triton", spec, "cpu")


# ---- 2: a rank's memory, estimated before launching ------------------------------------------
def test_item2_the_estimate_holds_the_engine_s_own_weights_and_pool(model_dir):
    """The parts that can be exact are: the weights and the pool of the engine a rank opens."""
    spec = JobSpec(str(model_dir), RuntimeConfig(kv_tokens=512, graph="off"))
    need = estimate_rank_memory(spec, rows=100, captured_rows=0)
    engine = make_engine(CPGroup(), spec)
    tensors = [*engine.parts.model.parameters(), *engine.parts.model.buffers()]
    assert need.weights == sum(t.numel() * t.element_size() for t in tensors)
    assert need.kv_pool == engine.parts.kv.pool_bytes
    assert need.graphs == 0 and need.activations > 0 and need.process == memory.PROCESS_BYTES["cpu"]
    # a CPU run's trace graphs keep every layer's intermediates of every captured row
    traced = estimate_rank_memory(JobSpec(str(model_dir), RuntimeConfig(kv_tokens=512, graph="breakable")), 100, 1024)
    assert traced.graphs == 1024 * need.activations // 100 * engine.cfg.num_layers


def test_item2_local_ranks_that_do_not_fit_are_refused_up_front(model_dir, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    spec = JobSpec(str(model_dir), RuntimeConfig(kv_tokens=512), cp_size=4)
    need = estimate_rank_memory(spec, 100, 128)
    total = 4 * need.total
    check_local_ranks_fit(spec, need, (total, "host memory", 1))  # fits exactly
    with pytest.raises(ConfigError, match=rf"^--cp 4: 4 ranks need about {total / 2**30:.2f} GiB \(a rank, "
                                          rf"estimated, .*more than the .* GiB of host memory; .*--no-memory-check"):
        check_local_ranks_fit(spec, need, (total - 1, "host memory", 1))
    # GPUs: ranks round robin over the devices; the most any one holds must fit it
    gpus = JobSpec(str(model_dir), RuntimeConfig(kv_tokens=512), cp_size=8)
    check_local_ranks_fit(gpus, need, (2 * need.total, "free memory of a GPU", 4))
    with pytest.raises(ConfigError, match=r"^--cp 8: 2 ranks on a GPU \(8 on 4\) need about"):
        check_local_ranks_fit(gpus, need, (2 * need.total - 1, "free memory of a GPU", 4))


def test_item2_gpu_memory_comes_from_nvidia_smi_for_the_visible_gpus(tmp_path, monkeypatch):
    """Not from CUDA: that would open a context on every GPU in the launching process."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '81000\\n40000\\n60000\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert memory.available_memory("cuda") == (40000 << 20, "free memory of a GPU", 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert memory.available_memory("cuda") == (60000 << 20, "free memory of a GPU", 2)
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert memory.available_memory("cuda") is None  # no nvidia-smi: not checked


def test_item2_the_command_refuses_before_launching_and_the_flag_overrides(capsys, tmp_path, model_dir, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(memory, "available_memory", lambda device: (1 << 30, "available host memory", 1))
    launched = []
    monkeypatch.setattr(cli_commands, "run_job_on_ranks", lambda *a: launched.append(a) or None)
    req = _requests(tmp_path, [{"tokens": [1, 2, 3]}])
    argv = ["prefill", "--model", model_dir, "--input", req, "--output", tmp_path / "o.pt", "--cp", 4]
    one_line_error(capsys, argv, match=r"--cp 4: 4 ranks need about .* GiB .*more than the 1.00 GiB of available "
                                       r"host memory")
    assert not launched
    assert main([str(a) for a in argv + ["--no-memory-check"]]) == 0 and len(launched) == 1


# ---- 5: the example request file, and a tune workload given to prefill -----------------------
def test_item5_the_readme_example_request_file_prefills(tmp_path, capsys):
    readme = (ROOT / "README.md").read_text()
    assert "examples/requests.jsonl" in readme
    lines = (ROOT / "examples" / "requests.jsonl").read_text().splitlines()
    assert len(lines) >= 2 and any(json.loads(x).get("prefix") for x in lines)
    assert main(["prefill", "--input", str(ROOT / "examples" / "requests.jsonl"), "--output", str(tmp_path / "o.pt"),
                 "--graph", "off", "--kv-tokens", "1024"]) == 0
    assert torch.load(tmp_path / "o.pt")["last_logits"].shape[0] == len(lines)


def test_item5_a_tune_workload_given_to_prefill_is_named_as_one(capsys, tmp_path):
    one_line_error(capsys, ["prefill", "--input", ROOT / "workloads" / "short.jsonl", "--output", tmp_path / "o.pt"],
                   match=r"short\.jsonl line 1: this looks like a `graphcp tune` workload .*expected "
                         r"\{\"tokens\": \[ids\.\.\.\], \"prefix\": K\} a line \(examples/requests\.jsonl\)")


# ---- 7: error details --------------------------------------------------------------------
def test_item7_an_unknown_flag_names_the_command(capsys):
    one_line_error(capsys, ["prefill", "--input", "x", "--output", "y", "--bogus", "1"],
                   match=r"unrecognized arguments: --bogus 1 \(see graphcp prefill --help\)")
    one_line_error(capsys, ["run", "--cpp", "2"], cmd="run", match="unrecognized arguments: --cpp 2")


def test_item7_a_bucket_file_for_another_cp_names_the_file(capsys, tmp_path, model_dir, monkeypatch):
    buckets = tmp_path / "b.json"
    assert main(["tune", "--synthetic", "short", "--cp", "4", "--output", str(buckets)]) == 0
    capsys.readouterr()
    monkeypatch.setattr(cli_commands, "run_job_on_ranks", lambda *a: pytest.fail("refused before launching"))
    req = _requests(tmp_path, [{"tokens": [1, 2, 3]}])
    one_line_error(capsys, ["prefill", "--model", model_dir, "--input", req, "--output", tmp_path / "o.pt",
                            "--buckets", buckets, "--cp", 2],
                   match=rf"bucket file {re.escape(str(buckets))} was tuned for cp_size=4, this run has cp_size=2")


def test_item7_an_out_of_vocabulary_token_names_file_and_line(capsys, tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(cli_commands, "run_job_on_ranks", lambda *a: pytest.fail("refused before launching"))
    req = _requests(tmp_path, [{"tokens": [1, 2, 3]}, {"tokens": [4, 5, VOCAB + 7], "prefix": 1}])
    one_line_error(capsys, ["prefill", "--model", model_dir, "--input", req, "--output", tmp_path / "o.pt"],
                   match=rf"req\.jsonl line 2, position 2: token id {VOCAB + 7} is outside the vocabulary "
                         rf"\[0, {VOCAB}\)$")


def test_item7_the_dsa_refusals_name_the_flags_typed(capsys, tmp_path, hf_model_dir, monkeypatch):
    folder = hf_model_dir("deepseek_v32", False, "float32")
    monkeypatch.setattr(cli_commands, "run_job_on_ranks", lambda *a: pytest.fail("refused before launching"))
    req = _requests(tmp_path, [{"tokens": [1, 2, 3]}])
    base = ["prefill", "--model", folder, "--input", req, "--output", tmp_path / "o.pt"]
    err = one_line_error(capsys, base + ["--kv-cache", "sharded"],
                         match=r"error: a deepseek_v32 model \(DSA\) with --kv-cache sharded: .*; use --kv-cache "
                               r"layer-split or --kv-cache replicated$")
    assert "RuntimeConfig" not in err and "pp_size" not in err
    one_line_error(capsys, base + ["--graph", "full", "--attention", "triton"], match=r"error: a deepseek_v32 model \(DSA\) with --graph full: "
                                                             r".*; use --graph breakable$")


# ---- 6: --help -------------------------------------------------------------------------
def test_item6_help_shows_defaults_presets_and_every_command_in_plain_text(capsys):
    for argv in (["--help"], *([c, "--help"] for c in ("run", "prefill", "tune", "profile", "pd-demo", "gpu-check"))):
        with pytest.raises(SystemExit):
            main(argv)
        text = capsys.readouterr().out
        assert "``" not in text, f"reST double backticks in graphcp {' '.join(argv)}"
        if argv[0] == "--help":
            assert "pd-demo (a prefill/decode" in text and "gpu-check (the one-shot GPU check)" in text
        if argv[0] in ("run", "prefill"):
            flat = " ".join(text.split())
            for shown in ("model dtype (default: float32)", "default: cpu", "(default: zigzag)",
                          "(default: torch;", "default-moe", "qwen3-1b-like", "default-dsa"):
                assert shown in flat, (argv[0], shown)
            assert ("default: 2)" if argv[0] == "run" else "default: 1)") in flat


# ---- 11: the README's length --------------------------------------------------------------
def test_item11_the_readme_stays_under_10_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 10_000, f"README.md is {size} bytes: move per-capability detail to docs/ and link it"


# ---- 8: output polish ------------------------------------------------------------------
def test_item8_a_dsa_batch_within_index_topk_says_why_nothing_was_scored():
    from graphcp.model.dsa.sparse import STAT_PAIRS, STAT_REPLICATED, STAT_ROWS, indexer_report

    none = {STAT_ROWS: 0, STAT_PAIRS: 0, STAT_REPLICATED: 0}
    assert indexer_report([none, none]) == ("indexer: no key scored (no row sees more than index_topk keys: "
                                            "attention is dense)")
    some = [{STAT_ROWS: 3, STAT_PAIRS: 30, STAT_REPLICATED: 100}, {STAT_ROWS: 4, STAT_PAIRS: 70, STAT_REPLICATED: 100}]
    assert indexer_report(some).endswith("replicated indexer's 100): rank 0: 3 rows, 30 pairs (0.300), "
                                         "rank 1: 4 rows, 70 pairs (0.700)")
