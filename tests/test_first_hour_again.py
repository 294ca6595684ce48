"""A new user's first hour, second pass (issue 42): one test (or group) per item of the
issue, numbered as there. Items 1, 4 and 9 (gpu-check, --device cuda) are tested with
gpu-check (tests/test_gpu_check.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import sigint_default

import graphcp.cli.commands as cli_commands
from graphcp.cli.jobs import INTERPRETER_SCALE, MIXED_LENGTHS, interpreted, mixed_batch
from graphcp.cli.main import COMMANDS, build_parser, main
from graphcp.config import RuntimeConfig
from graphcp.dist import short_cause
from graphcp.jobs.spec import JobSpec
from graphcp.runtime.engine import PrefillEngine

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
#: how long a test waits for a process to do what it must (a liveness bound, never a timing claim)
PATIENCE_S = 120


@pytest.fixture(scope="module")
def model_dir(hf_model_dir) -> Path:
    return hf_model_dir("qwen3", False, "float32")


def _one_line(capsys, argv: list, cmd: str) -> str:
    """main() in-process must exit 2 (argparse's refusals too) with one stderr line."""
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"graphcp {cmd}: error: ") and "Traceback" not in err, err
    return err


def _alive(pid: int) -> bool:
    """A process that runs (a zombie has finished: its parent has not reaped it yet)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# ---- 2: Ctrl-C ------------------------------------------------------------------------------
_INTERRUPTED_IN_TORCH = """
import builtins, os, signal, sys
real = builtins.__import__
def hook(name, *args, **kwargs):
    if name.startswith("torch.") and not hook.sent:  # inside torch's own import
        hook.sent = True
        os.kill(os.getpid(), signal.SIGINT)
    return real(name, *args, **kwargs)
hook.sent = False
builtins.__import__ = hook
from graphcp.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_item2_ctrl_c_while_torch_imports_is_one_line():
    """The first seconds of a run are torch's imports: a Ctrl-C there printed a 35-60
    line KeyboardInterrupt traceback."""
    p = subprocess.run([sys.executable, "-c", _INTERRUPTED_IN_TORCH, "run", "--graph", "off"], env=ENV,
                       capture_output=True, text=True, timeout=PATIENCE_S, preexec_fn=sigint_default)
    assert (p.returncode, p.stderr) == (130, "graphcp run: interrupted\n"), p.stderr[-3000:]


_SLEEPING_RUN = """
import os, sys, time
import graphcp.cli.commands as commands
folder = sys.argv[1]
def sleeping_job(group, spec):
    open(os.path.join(folder, f"{group.rank}.pid"), "w").write(str(os.getpid()))
    time.sleep(600)
commands.run_job = sleeping_job
from graphcp.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


@linux_only
@pytest.mark.parametrize("who", ["launcher", "process group"])
def test_item2_ctrl_c_stops_every_rank_at_once(tmp_path, model_dir, who):
    """``timeout -s INT`` signals the launcher alone, a terminal's Ctrl-C the whole
    process group: either way one line, exit 130, and no rank left running (the ranks
    went on capturing, and the command exited 12 s later)."""
    p = subprocess.Popen([sys.executable, "-c", _SLEEPING_RUN, str(tmp_path), "run", "--model", str(model_dir),
                          "--graph", "off", "--cp", "2", "--no-memory-check"], env=ENV, start_new_session=True,
                         stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    try:
        _wait_for(lambda: len(list(tmp_path.glob("*.pid"))) == 2 or p.poll() is not None, "both ranks to start")
        ranks = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
        assert len(ranks) == 2, p.stderr.read()
        if who == "launcher":
            os.kill(p.pid, signal.SIGINT)
        else:
            os.killpg(p.pid, signal.SIGINT)
        err = p.communicate(timeout=PATIENCE_S)[1]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert (p.returncode, err) == (130, "graphcp run: interrupted\n"), err[-3000:]
    assert not [r for r in ranks if _alive(r)]  # stopped before the launcher returned


def test_item2_an_interrupt_in_main_is_one_line(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_commands, "cmd_run", interrupted)
    assert main(["run"]) == 130
    assert capsys.readouterr().err == "graphcp run: interrupted\n"


# ---- 3: a killed launcher, a killed rank -----------------------------------------------------
_SLEEPING_RANKS = """
import os, sys, time
from graphcp.dist import launch
def sleeping(group, folder):
    open(os.path.join(folder, f"{group.rank}.pid"), "w").write(str(os.getpid()))
    time.sleep(600)
launch(sleeping, 2, sys.argv[1], timeout_s=600)
"""


@linux_only
def test_item3_ranks_die_with_a_killed_launcher(tmp_path):
    """kill -9 of the launcher left both ranks running at 90 % CPU for 30-40 s (on GPUs,
    holding the devices)."""
    p = subprocess.Popen([sys.executable, "-c", _SLEEPING_RANKS, str(tmp_path)], env=ENV)
    try:
        _wait_for(lambda: len(list(tmp_path.glob("*.pid"))) == 2, "both ranks to start")
        ranks = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
        p.kill()
        p.wait(timeout=PATIENCE_S)
        _wait_for(lambda: not any(_alive(r) for r in ranks), "the orphaned ranks to die")
    finally:
        p.kill()
        for f in tmp_path.glob("*.pid"):
            if _alive(pid := int(f.read_text())):
                os.kill(pid, signal.SIGKILL)


def test_item3_a_lost_peer_is_said_in_one_short_clause():
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                        "by peer [127.0.0.1]:42919. This is typically caused by a remote worker crashing. Check the "
                        "logs of the remote worker before reporting an error. GLHF! \N{UMBRELLA ON GROUND}")
    assert short_cause(gloo) == "RuntimeError: Connection closed by peer [127.0.0.1]:42919"
    assert short_cause(TimeoutError("x" * 300)) == "TimeoutError: " + "x" * 97 + "..."


# ---- 5: every flag's bad value names the flag ------------------------------------------------
#: internal names the command line must not show (fields of RuntimeConfig / ParallelConfig;
#: "--pp-microbatches" is a flag, "microbatches" alone a field)
INTERNAL = re.compile(r"RuntimeConfig|ParallelConfig|(?<![-\w])(?:" + "|".join((
    "cp_size", "tp_size", "dp_size", "pp_size", "collective_timeout_s", "page_size", "max_requests", "kv_tokens",
    "peak_tflops", "link_gb_per_s", "aux_hidden_layers", "microbatches", "graph_backend", "pp_layers")) + r")(?![-\w])")
#: flags whose value is a file or folder: their error may name the path instead
PATHS = {"--model", "--buckets", "--draft", "--input", "--output", "--export-kv", "--stats"}


def _bad_values(tmp: Path) -> dict[str, list[list[str]]]:
    """Every value-taking flag of `graphcp prefill` (the runtime flags and its own) ->
    command-line pieces that must be refused naming it."""
    (tmp / "a-file").write_text("x")
    missing = str(tmp / "missing" / "x")
    return {
        "--model": [[missing]], "--dtype": [["float64"]], "--device": [["tpu"]],
        "--cp": [["0"], ["abc"], ["3"]], "--tp": [["3", "--cp", "2"], ["16"]], "--dp": [["0"], ["-1"]],
        "--pp": [["0"], ["99"]], "--pp-layers": [["0,2", "--pp", "2"], ["1", "--pp", "2"], ["1,5", "--pp", "2"]],
        "--pp-microbatches": [["0"]], "--aux-hidden-layers": [["-1"], ["1,1"], ["99"]],
        "--layout": [["diagonal"]], "--graph": [["partial"]], "--graph-backend": [["cuda"]],
        "--attention": [["flashinfer"], ["trtllm"], ["bogus"]], "--buckets": [[missing]],
        "--page-size": [["0"], ["5000"]], "--kv-tokens": [["0"], ["-16"]],
        "--kv-cache": [["sharded", "--layout", "interleave"]], "--exchange": [["pass-kv"]],
        "--peak-tflops": [["0"], ["nan"]], "--link-gb-per-s": [["-1"], ["inf"]], "--max-requests": [["0"]],
        "--state-slots": [["0"]],
        "--timeout": [["0"], ["inf"]], "--moe": [["xx"]], "--draft": [[missing]], "--input": [[missing]],
        "--output": [[str(tmp)]], "--export-kv": [[str(tmp / "a-file")]], "--stats": [[str(tmp)]],
    }


def test_item5_every_flag_s_bad_value_names_the_flag(capsys, tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(cli_commands, "run_job_on_ranks", lambda *a: pytest.fail("refused before launching"))
    req = tmp_path / "r.jsonl"
    req.write_text('{"tokens": [1, 2, 3]}\n')
    bad = _bad_values(tmp_path)
    takes_value = {a.option_strings[-1] for a in build_parser(["prefill"]).commands["prefill"]._actions
                   if a.option_strings and a.nargs != 0 and a.help != argparse.SUPPRESS}
    assert takes_value == set(bad), f"flags without a bad value here: {takes_value - set(bad)}"
    base = {"--model": str(model_dir), "--input": str(req), "--output": str(tmp_path / "o.pt")}
    wrong = []
    for flag, cases in bad.items():
        for case in cases:
            argv = ["prefill", *(x for k, v in base.items() if k != flag for x in (k, v)), flag, *case]
            err = _one_line(capsys, argv, "prefill")
            named = flag in err or (flag in PATHS and case[0] in err)
            if not named or INTERNAL.search(err):
                wrong.append(f"{flag} {' '.join(case)}: {err.strip()}")
    assert not wrong, "\n".join(wrong)


# ---- 6: --graph full on a CPU ----------------------------------------------------------------
def test_item6_the_interpreter_runs_a_shorter_batch_and_only_its_buckets(model_dir):
    """`graphcp run --graph full --attention triton` had not captured its first of 9
    buckets after 90 s: in Triton's interpreter it runs the batch 32 times shorter and
    captures only the buckets up to the one it uses (measured: minutes)."""
    full, small = mixed_batch(512), mixed_batch(512, scale=INTERPRETER_SCALE)
    assert [len(t) for t in full] == list(MIXED_LENGTHS)
    assert [len(t) for t in small] == [48, 20, 9, 4, 3, 1]  # still a request shorter than 2C, and one token
    assert interpreted(JobSpec(runtime=RuntimeConfig(attention="triton")))
    assert not interpreted(JobSpec(runtime=RuntimeConfig(attention="torch")))
    engine = PrefillEngine(str(model_dir), RuntimeConfig(graph="breakable", kv_tokens=512))
    stats = engine.capture(up_to=64)
    assert [s.capacity for s in stats] == [64, 32, 16] and sorted(engine.parts.runner.graphs) == [16, 32, 64]


# ---- 7: parsing before torch -----------------------------------------------------------------
_PARSE_ONLY = """
import sys
from graphcp.cli.main import main
for argv in ([], ["--help"], ["--version"], ["bogus"], ["run", "--cp", "abc"], ["prefill", "--bogus", "1"],
             ["tune", "--help"], ["profile", "--iters", "0", "--out", "x"], ["pd-demo", "--steps", "0"]):
    try:
        main(argv)
    except SystemExit:
        pass
    print(argv, "torch" in sys.modules, file=sys.stderr)
"""


def test_item7_help_and_a_bad_flag_do_not_import_torch():
    """--help took 5.3 s and rejecting --cp abc 5 s: torch was imported before parsing."""
    p = subprocess.run([sys.executable, "-c", _PARSE_ONLY], env=ENV, capture_output=True, text=True,
                       timeout=PATIENCE_S)
    imported = [line for line in p.stderr.splitlines() if line.endswith(" True")]
    assert p.returncode == 0 and not imported and p.stderr.count(" False") == 9, p.stderr


def test_item7_the_command_line_builds_only_the_command_given():
    stand_ins = build_parser(())
    assert set(stand_ins.commands) == set(COMMANDS)
    full = build_parser()
    # a stand-in says what its command does, in the words the command's own parser uses
    for action in (a for p in (stand_ins, full) for a in p._subparsers._group_actions):
        assert {c.dest: c.help for c in action._choices_actions} == {n: h for n, (h, _) in COMMANDS.items()}


# ---- 8: --help, --version, docs ----------------------------------------------------------------
def test_item8_help_shows_every_flag_s_default():
    """docs/cli.md promises each flag's default in --help (gpu-check's flags are its own:
    tests/test_gpu_check.py)."""
    missing = []
    for cmd, parser in build_parser().commands.items():
        if cmd == "gpu-check":
            continue
        for a in parser._actions:
            if (not a.option_strings or a.required or a.default is None or a.default is argparse.SUPPRESS
                    or isinstance(a, (argparse._HelpAction, argparse._StoreTrueAction))):
                continue
            if "default" not in (a.help or ""):
                missing.append(f"graphcp {cmd} {a.option_strings[-1]} (default {a.default!r})")
    assert not missing, "\n".join(missing)


def test_item8_version_help_and_the_moe_flag(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert re.fullmatch(r"graphcp \S+ \(torch \S+, Python \S+\)\n", capsys.readouterr().out)
    for cmd in ("run", "prefill", "profile", "pd-demo"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        text = capsys.readouterr().out
        usage = text.split("\n\n")[0]
        assert len(usage.splitlines()) <= 2 and "--page-size" not in usage, usage  # not every flag twice
        flat = " ".join(text.split())
        assert "ep splits the experts over the --tp ranks of a stage" in flat
        assert "$GRAPHCP_CACHE/models" in flat
    readme = (ROOT / "README.md").read_text()
    assert "$GRAPHCP_CACHE/models" in readme and "--cp 1" in readme
    assert any(json.loads(line).get("prefix") for line in (ROOT / "examples" / "requests.jsonl").read_text().split("\n")
               if line)


# ---- 10: silently accepted or confusing --------------------------------------------------------
def test_item10_moe_on_a_dense_model_says_it_has_no_effect(capsys, tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(cli_commands, "run_job_on_ranks", lambda *a: None)  # a non-zero torchrun rank's return
    req = tmp_path / "r.jsonl"
    req.write_text('{"tokens": [1, 2, 3]}\n')
    argv = ["prefill", "--model", str(model_dir), "--input", str(req), "--output", str(tmp_path / "o.pt")]
    assert main(argv + ["--moe", "tp"]) == 0
    assert re.fullmatch(r"graphcp prefill: note: --moe tp has no effect: \S+config.json has no mixture-of-experts "
                        r"layers\n", capsys.readouterr().err)
    assert main(argv) == 0 and capsys.readouterr().err == ""  # not given: nothing to say


def test_item10_kernel_backends_on_a_cpu_say_they_need_a_gpu(capsys, tmp_path, model_dir):
    (tmp_path / "r.jsonl").write_text('{"tokens": [1, 2, 3]}\n')
    err = _one_line(capsys, ["prefill", "--model", model_dir, "--input", tmp_path / "r.jsonl", "--output",
                             tmp_path / "o.pt", "--attention", "flashinfer"], "prefill")
    assert "--attention flashinfer runs CUDA kernels and needs --device cuda" in err and "pip" not in err, err


def test_item10_exported_kv_files_are_as_readable_as_out_pt(tmp_path, model_dir):
    req = tmp_path / "r.jsonl"
    req.write_text('{"tokens": [1, 2, 3, 4]}\n')
    assert main(["prefill", "--model", str(model_dir), "--input", str(req), "--output", str(tmp_path / "o.pt"),
                 "--graph", "off", "--kv-tokens", "256", "--export-kv", str(tmp_path / "kv")]) == 0
    modes = {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "o.pt", tmp_path / "kv" / "0.safetensors")}
    assert len(modes) == 1, modes  # safetensors wrote 0600, torch.save 0644 (the umask's)


def test_item10_file_locations_are_written_one_way(capsys, tmp_path):
    bad_requests, bad_workload = tmp_path / "reqs.jsonl", tmp_path / "wl.jsonl"
    bad_requests.write_text('{"tokens": [1]}\n{"tokens": [1, 2\n')
    bad_workload.write_text('{"extend": [0], "prefix": [0]}\n')
    err = _one_line(capsys, ["prefill", "--input", bad_requests, "--output", tmp_path / "o.pt"], "prefill")
    assert f"error: {bad_requests} line 2: " in err, err
    err = _one_line(capsys, ["tune", "--workload", bad_workload, "--cp", "2", "--output", tmp_path / "b.json"], "tune")
    assert f"error: {bad_workload} line 1: " in err, err


def test_item10_the_tuner_leads_with_equal_bucket_counts(capsys, tmp_path):
    assert main(["tune", "--synthetic", "short:batches=50", "--cp", "2", "--output", str(tmp_path / "b.json")]) == 0
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    table = rows[1:rows.index("capacity")] if "capacity" in rows else rows[1:]
    assert table[0] == "sglang" and table[1].startswith("tuned@") and table[-1] == "tuned", table

