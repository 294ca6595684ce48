"""A new user's first hour, third pass (issue 45): items 5, 7, 8, 9 and 11, one test (or
group) per item, numbered as there. Every refusal is exit code 2, one stderr line naming
the bad value and what was expected, and nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphcp.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
VOCAB = 512  # the tiny models' (tests/conftest.py)


@pytest.fixture(scope="module")
def model_dir(hf_model_dir) -> Path:
    return hf_model_dir("qwen3", False, "float32")


def _lines(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _one_line(capsys, argv: list, cmd: str) -> str:
    """main() in-process must exit 2 (argparse's refusals too) with one stderr line; the line."""
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"graphcp {cmd}: error: ") and "Traceback" not in err, err
    return err


# ---- 5: tune --plot without matplotlib --------------------------------------------------------
_NO_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # import matplotlib raises ImportError, as where it is not installed
from graphcp.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_item5_plot_without_matplotlib_is_refused_before_writing(tmp_path):
    out, png = tmp_path / "buckets.json", tmp_path / "tune.png"
    p = subprocess.run([sys.executable, "-c", _NO_MATPLOTLIB, "tune", "--workload", ROOT / "workloads" / "longctx.jsonl",
                        "--cp", "4", "--max-buckets", "8", "--output", out, "--plot", png], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith("graphcp tune: error: --plot needs matplotlib") and 'pip install -e ".[plot]"' in p.stderr
    assert p.stdout == "" and not out.exists() and not png.exists()


# ---- 7: errors that name internals, or nothing --------------------------------------------------
def test_item7_draft_tokens_without_a_draft_names_the_flag_it_needs(capsys, tmp_path):
    """``generate --draft DIR`` now decodes speculatively (issue 47); ``--draft-tokens``
    without ``--draft`` is refused from the flags alone, before the model is read (none
    exists here), naming the flag it needs."""
    out = tmp_path / "o.pt"
    err = _one_line(capsys, ["generate", "--model", tmp_path / "no-model", "--input", _lines(tmp_path / "r.jsonl", [
        {"tokens": [1, 2]}]), "--output", out, "--max-new-tokens", "2", "--draft-tokens", "2"], "generate")
    assert "--draft-tokens 2 needs --draft DIR" in err and "no-model" not in err, err
    assert not out.exists()


def test_item7_a_model_refusing_generate_names_generate(hf_model_dir, monkeypatch):
    """A model's decode refusal reached through generate names generate (a stand-in
    refusal of the hybrid's decode: the real ones are being built, issue 47)."""
    from graphcp import ConfigError, PrefillEngine, RuntimeConfig, combinations

    stand_in = combinations.Refusal(("model", ("hybrid",)), ("decode", ("on",)), "a stand-in reason",
                                    (("model", "dense"),), "stand-in")
    monkeypatch.setattr(combinations, "REFUSALS", (stand_in, *combinations.REFUSALS))
    engine = PrefillEngine(hf_model_dir("qwen3_next"), RuntimeConfig(kv_tokens=256))
    snap = engine.parts.kv.snapshot()
    with pytest.raises(ConfigError, match=r"with PrefillEngine\.generate: a stand-in reason") as e:
        engine.generate([[1, 2]], 3)
    assert "PrefillEngine.decode" not in str(e.value) and engine.parts.kv.snapshot() == snap


@pytest.mark.parametrize("value,match", [
    ("4,1,2", "expected increasing integers such as 1,2,4, got '4,1,2'"),
    ("1,70000", "expected integers >= 1 and <= 65536, got '1,70000'"),
])
def test_item7_decode_buckets_are_refused_in_the_flags_name(capsys, tmp_path, value, match):
    out = tmp_path / "o.pt"
    err = _one_line(capsys, ["generate", "--input", tmp_path / "r.jsonl", "--output", out, "--max-new-tokens", "2",
                             "--decode-buckets", value], "generate")
    assert f"argument --decode-buckets: {match}" in err and "RuntimeConfig" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("cmd", ["generate", "prefill"])
def test_item7_a_full_kv_pool_names_kv_tokens(capsys, tmp_path, model_dir, cmd):
    """examples/requests.jsonl's case: the batch's prompts need more pages than 64 tokens
    hold (and generate's progress bar starts with the first step: one line)."""
    out = tmp_path / "o.pt"
    req = _lines(tmp_path / "r.jsonl", [{"tokens": list(range(1, 41))}, {"tokens": list(range(1, 41))}])
    more = ["--max-new-tokens", "20"] if cmd == "generate" else []
    err = _one_line(capsys, [cmd, "--model", model_dir, "--input", req, "--output", out, "--kv-tokens", "64",
                             "--graph", "off", *more], cmd)
    assert "KV cache full: the batch needs 6 more pages of 16 tokens, 4 are free (pool of 4 usable pages); " \
           "raise --kv-tokens (given 64)" in err and "RuntimeConfig" not in err, err
    assert not out.exists()


def test_item7_too_few_state_slots_name_the_flag(capsys, tmp_path, hf_model_dir):
    out = tmp_path / "o.pt"
    req = _lines(tmp_path / "r.jsonl", [{"tokens": [1, 2, 3]}, {"tokens": [4, 5]}])
    err = _one_line(capsys, ["prefill", "--model", hf_model_dir("qwen3_next"), "--input", req, "--output", out,
                             "--state-slots", "1", "--graph", "off", "--kv-tokens", "256"], "prefill")
    assert "state slots full: the batch needs 2 live requests' states, the cache keeps 1; raise --state-slots " \
           "(given 1)" in err and "RuntimeConfig" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("cmd,rows,match", [
    ("generate", [{"turn": [[1, 2]]}],
     r"line 1: unknown keys \['turn'\]: expected \{\"tokens\": \[ids\.\.\.\], \"prefix\": K\} or "
     r"\{\"turns\": \[\[ids\.\.\.\], \.\.\.\], \"max_new_tokens\": N\} a line"),
    ("prefill", [{"turns": [[1, 2], [3]]}],
     r"line 1: this looks like a conversation \(\"turns\": `graphcp generate` reads it\): expected "
     r"\{\"tokens\": \[ids\.\.\.\], \"prefix\": K\} a line"),
])
def test_item7_a_line_of_the_wrong_kind_says_which_it_is(capsys, tmp_path, cmd, rows, match):
    out = tmp_path / "o.pt"
    more = ["--max-new-tokens", "2"] if cmd == "generate" else []
    err = _one_line(capsys, [cmd, "--input", _lines(tmp_path / "r.jsonl", rows), "--output", out, *more], cmd)
    assert __import__("re").search(match, err), err
    assert not out.exists()


def test_item7_a_request_file_given_to_tune_is_named_as_one(capsys, tmp_path):
    out = tmp_path / "b.json"
    err = _one_line(capsys, ["tune", "--workload", ROOT / "examples" / "requests.jsonl", "--cp", "2", "--output", out],
                    "tune")
    assert 'requests.jsonl line 1: this looks like a request file ("tokens" ids a line' in err, err
    assert 'expected {"extend": [...], "prefix": [...]} a line (workloads/README.md)' in err and "missing" not in err
    assert not out.exists()


def test_item7_a_request_file_given_as_buckets_is_named_as_one(capsys, tmp_path):
    out = tmp_path / "o.pt"
    req = _lines(tmp_path / "r.jsonl", [{"tokens": [1, 2]}])
    err = _one_line(capsys, ["prefill", "--input", req, "--output", out, "--buckets",
                             ROOT / "examples" / "requests.jsonl"], "prefill")
    assert "--buckets: bucket file " in err and "not valid JSON (Extra data at line 2 column 1): this looks like a " \
           "request file" in err and "expected the JSON object `graphcp tune --output` writes" in err, err
    assert not out.exists()


# ---- 9: a bad input file is refused before anything loads ------------------------------------
_NOTHING_LOADED = """
import sys
from graphcp.cli.main import main
code = main(sys.argv[1:])
assert "torch" not in sys.modules, "torch was imported before the file was refused"
sys.exit(code)
"""


@pytest.mark.parametrize("cmd,flag,more", [
    ("prefill", "--input", ["--output", "o.pt"]),
    ("generate", "--input", ["--output", "o.pt", "--max-new-tokens", "2"]),
    ("profile", "--workload", ["--out", "prof"]),
    ("run", "--buckets", ["--json", "o.json"]),
])
def test_item9_a_bad_file_is_refused_before_torch_or_the_model(tmp_path, cmd, flag, more):
    """The model named does not exist and torch is never imported: the file's error comes first."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": "1 2 3"}\n')
    p = subprocess.run([sys.executable, "-c", _NOTHING_LOADED, cmd, flag, bad, "--model", tmp_path / "no-model",
                        *more], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith(f"graphcp {cmd}: error: ") and "bad.jsonl" in p.stderr and "no-model" not in p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bad.jsonl"]  # no output, no --out folder


# ---- 8: silently accepted ----------------------------------------------------------------------
def test_item8_an_empty_turn_is_refused_with_the_file_and_line(capsys, tmp_path):
    out = tmp_path / "o.pt"
    req = _lines(tmp_path / "r.jsonl", [{"tokens": [1, 2]}, {"turns": [[1, 2], []]}])
    err = _one_line(capsys, ["generate", "--input", req, "--output", out, "--max-new-tokens", "2"], "generate")
    assert "r.jsonl line 2: turn 1 is empty (every turn needs a prompt token)" in err, err
    assert not out.exists()


def test_item8_the_api_refuses_an_empty_turn_too(tmp_path, model_dir):
    from graphcp import BatchError, Conversation, PrefillEngine, RuntimeConfig

    engine = PrefillEngine(model_dir, RuntimeConfig(kv_tokens=256))
    with pytest.raises(BatchError, match=r"^generate: request 0: turn 1 is empty"):
        engine.generate([Conversation([[1, 2], []])], 2)
    assert engine.parts.kv.stored_tokens() == 0


def test_item8_a_stop_token_past_the_vocabulary_is_refused(capsys, tmp_path, model_dir, monkeypatch):
    import graphcp.cli.generate as cli_generate

    monkeypatch.setattr(cli_generate, "run_job_on_ranks", lambda *a: pytest.fail("refused before launching"))
    out = tmp_path / "o.pt"
    err = _one_line(capsys, ["generate", "--model", model_dir, "--input", _lines(tmp_path / "r.jsonl", [
        {"tokens": [1, 2]}]), "--output", out, "--max-new-tokens", "2", "--stop", "7,99999"], "generate")
    assert f"--stop: token id 99999 is outside the vocabulary [0, {VOCAB})" in err, err
    assert not out.exists()


def test_item7_generate_stop_takes_a_list_of_ids(model_dir):
    """engine.generate(..., stop=879) raised a raw TypeError from iterating an int."""
    from graphcp import BatchError, PrefillEngine, RuntimeConfig

    engine = PrefillEngine(model_dir, RuntimeConfig(kv_tokens=256))
    for stop, match in ((879, r"^generate: stop must be a list of token ids, got int 879; one stop token is \[879\]$"),
                        ([1, 2.5], r"got an item 2\.5$"), ([VOCAB], rf"token id {VOCAB} is outside the vocabulary")):
        with pytest.raises(BatchError, match=match):
            engine.generate([[1, 2]], 2, stop=stop)
    assert engine.parts.kv.stored_tokens() == 0
    assert engine.generate([[1, 2]], 2, stop=(3,)).finish  # a tuple is a list of ids too


@pytest.mark.parametrize("cmd", ["prefill", "generate"])
def test_item8_flags_a_dense_model_ignores_are_noted_by_both_commands(capsys, tmp_path, model_dir, monkeypatch, cmd):
    import graphcp.cli.commands as cli_commands
    import graphcp.cli.generate as cli_generate

    class Launched(Exception):
        pass

    def launch(*args):
        raise Launched  # the notes come before any rank starts: stop there

    monkeypatch.setattr(cli_commands if cmd == "prefill" else cli_generate, "run_job_on_ranks", launch)
    more = ["--max-new-tokens", "2"] if cmd == "generate" else []
    argv = [cmd, "--model", str(model_dir), "--input", str(_lines(tmp_path / "r.jsonl", [{"tokens": [1, 2]}])),
            "--output", str(tmp_path / "o.pt"), *more]
    capsys.readouterr()
    with pytest.raises(Launched):
        main(argv + ["--moe", "ep", "--state-slots", "4"])
    err = capsys.readouterr().err.splitlines()
    assert err == [f"graphcp {cmd}: note: --moe ep has no effect: {model_dir}/config.json has no mixture-of-experts "
                   "layers", f"graphcp {cmd}: note: --state-slots 4 has no effect: {model_dir}/config.json has no "
                   "linear-attention layers"], err


def test_item8_help_and_docs_agree_on_moe_without_experts(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    doc = " ".join((ROOT / "docs" / "cli.md").read_text().split())
    said = "A model without experts runs the same either way, and says so in a note when the flag is given"
    assert said in doc and said.lower() in flat.lower() and "refuses the flag" not in flat


# ---- 11: docs slips ----------------------------------------------------------------------------
def test_item11_prefill_names_the_file_and_line_as_generate_does(capsys, tmp_path, model_dir):
    out = tmp_path / "o.pt"
    req = _lines(tmp_path / "r.jsonl", [{"tokens": [1, 2]}, {"tokens": [1] * 4097}])
    err = _one_line(capsys, ["prefill", "--model", model_dir, "--input", req, "--output", out], "prefill")
    assert "r.jsonl line 2: 4097 prompt tokens exceed the model's context of 4096" in err and "request 1" not in err
    assert not out.exists()


def test_item11_the_export_names_its_folder_once(capsys, tmp_path, model_dir):
    req = _lines(tmp_path / "r.jsonl", [{"tokens": [1, 2, 3]}])
    assert main(["prefill", "--model", str(model_dir), "--input", str(req), "--output", str(tmp_path / "o.pt"),
                 "--graph", "off", "--export-kv", f"{tmp_path / 'KV'}/"]) == 0
    said = capsys.readouterr().out
    assert f"; KV -> {tmp_path / 'KV'}/<i>.safetensors" in said and "//" not in said, said
    assert (tmp_path / "KV" / "0.safetensors").is_file()


def test_item11_the_readme_example_prints_what_it_made(capsys, model_dir):
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert code.count('"default"') == 1
    exec(compile(code.replace('"default"', repr(str(model_dir))), "README.md", "exec"), {})  # as a script runs it
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and printed[0].startswith("tensor([") and printed[1] == "7", printed


def test_item11_docs_say_what_they_mean():
    readme = (ROOT / "README.md").read_text()
    assert "2 for the others" not in readme and "`tune` needs it" in readme  # tune has no --cp default
    pd = (ROOT / "docs" / "pd.md").read_text()
    blocks = [b.split("```", 1)[0] for b in pd.split("```python\n")[1:]]
    snippet = next(b for b in blocks if "load_kv(" in b)  # the load_kv example
    assert "torch.tensor" in snippet and snippet.startswith("import torch\n")
    from graphcp.gpucheck.cli import default_out

    assert "output folder" in default_out.__doc__ and "comes back" not in default_out.__doc__
