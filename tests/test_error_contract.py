"""The error contract, case by case (issue 13): every bad input is one stderr line
``graphcp CMD: error: ...`` with exit code 2, no traceback, nothing written; every
refused batch is a BatchError that leaves the KV cache as it was. One test (or
parametrised group) per case of the issue, numbered as there.

Imports stay within names that existed before the fix, so each test fails on the
old code by its assertion rather than at import.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from graphcp import BatchError, PrefillEngine, Request
from graphcp.cli.main import main
from graphcp.config import RuntimeConfig
from graphcp.errors import ConfigError
from graphcp.kv.handle import KVHandle

VOCAB = 512  # the tiny checkpoints of conftest.py


@pytest.fixture(scope="module")
def model_dir(hf_model_dir) -> Path:
    return hf_model_dir("qwen2", False, "float32")


def one_line_error(capsys, argv, cmd="prefill", code=2, match=None) -> str:
    """Run the CLI in-process; check exit code, exactly one stderr line, no traceback."""
    try:
        got = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors (a flag's value out of range)
        got = e.code
    err = capsys.readouterr().err
    assert got == code, err
    assert err.endswith("\n") and len(err.splitlines()) == 1, f"expected one stderr line, got:\n{err}"
    assert err.startswith(f"graphcp {cmd}: error: ") and "Traceback" not in err, err
    if match is not None:
        assert re.search(match, err), err
    return err


def _requests(tmp_path: Path, lines: list, name: str = "req.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def _prefill(model, req, out, *extra):
    return ["prefill", "--model", model, "--input", req, "--output", out, "--graph", "off", *extra]


# ---- 1: errors inside a rank under --cp N > 1 ------------------------------------------------
def test_case01_rank_error_is_the_rank_message_in_one_line(capsys, tmp_path, model_dir, monkeypatch):
    req = _requests(tmp_path, [{"tokens": [1, 2, VOCAB + 88]}])
    out = tmp_path / "out.pt"
    single = one_line_error(capsys, _prefill(model_dir, req, out))
    double = one_line_error(capsys, _prefill(model_dir, req, out, "--cp", "2"))
    # the same clear message at CP 1 and 2 (checked before ranks start: it names the line)
    assert double == single and "req.jsonl line 1, position 2: token id 600 is outside the vocabulary" in double
    assert not out.exists()
    # intermediate_size 128 does not divide by 5: refused before any rank starts
    one_line_error(capsys, _prefill(model_dir, req, out, "--cp", "5"), match=r"intermediate_size=128 does not divide")
    # a request past the KV pool at CP 2 (a rank finds it: the pool is the cache mode's); the
    # traceback only on request (GRAPHCP_DEBUG)
    long = _requests(tmp_path, [{"tokens": [1] * 300}], "long.jsonl")
    monkeypatch.setenv("GRAPHCP_DEBUG", "1")
    assert main([str(a) for a in _prefill(model_dir, long, out, "--cp", "2", "--kv-tokens", "64")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "--- rank " in err  # the failing rank's traceback, with --debug
    assert re.match(r"graphcp prefill: error: request 0: .*raise --kv-tokens \(given 64\)", err.splitlines()[-1]), err


# ---- 2: --output that cannot be written: refused before any work -------------------------------
@pytest.mark.parametrize("where", ["missing-folder", "a-folder"])
def test_case02_output_checked_before_any_work(capsys, tmp_path, model_dir, monkeypatch, where):
    import graphcp.cli.commands

    def no_work(*a, **k):
        raise AssertionError("the forward ran although --output cannot be written")

    monkeypatch.setattr(graphcp.cli.commands, "run_job_on_ranks", no_work)
    req = _requests(tmp_path, [{"tokens": [1, 2, 3]}])
    out = tmp_path / "nope" / "out.pt" if where == "missing-folder" else tmp_path
    one_line_error(capsys, _prefill(model_dir, req, out), match=r"--output .*(does not exist|is a folder)")


# ---- 3: a --buckets file holding a JSON list --------------------------------------------------
def test_case03_bucket_file_holding_a_list(capsys, tmp_path, model_dir):
    b = tmp_path / "b.json"
    b.write_text("[16, 32, 64]")
    req = _requests(tmp_path, [{"tokens": [1, 2, 3]}])
    one_line_error(capsys, _prefill(model_dir, req, tmp_path / "o.pt", "--buckets", b),
                   match=r"bucket file .*b\.json: expected a JSON object")


# ---- 4: config.json with wrong types --------------------------------------------------------
@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda c: [], r"config\.json: expected a JSON object"),
        (lambda c: {**c, "hidden_size": None}, r"config\.json: hidden_size must be an integer, got None"),
        (lambda c: {**c, "num_attention_heads": 0, "head_dim": None},
         r"config\.json: num_attention_heads must be >= 1, got 0"),
        (lambda c: {**c, "num_hidden_layers": "two"}, r"config\.json: num_hidden_layers must be an integer, got 'two'"),
        (lambda c: {**c, "rope_parameters": "default"}, r"config\.json: rope_parameters must be an object"),
    ],
    ids=["list", "hidden-null", "heads-zero", "layers-string", "rope-string"],
)
def test_case04_config_types_name_file_and_key(capsys, tmp_path, model_dir, edit, match):
    d = Path(shutil.copytree(model_dir, tmp_path / "m"))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(edit(cfg)))
    req = _requests(tmp_path, [{"tokens": [1, 2, 3]}])
    one_line_error(capsys, _prefill(d, req, tmp_path / "o.pt"), match=match)


# ---- 5: a corrupt model.safetensors ---------------------------------------------------------
@pytest.mark.parametrize("corrupt", ["truncated", "empty", "garbage", "bad-header"])
def test_case05_corrupt_safetensors_names_the_file(capsys, tmp_path, model_dir, corrupt):
    d = Path(shutil.copytree(model_dir, tmp_path / "m"))
    st = d / "model.safetensors"
    data = st.read_bytes()
    blob = {"truncated": data[: len(data) // 2], "empty": b"",
            "garbage": np.random.default_rng(0).bytes(4096),
            "bad-header": (64).to_bytes(8, "little") + b"{not json" + data[17:]}[corrupt]
    st.write_bytes(blob)
    req = _requests(tmp_path, [{"tokens": [1, 2, 3]}])
    one_line_error(capsys, _prefill(d, req, tmp_path / "o.pt"), match=r"model\.safetensors: not a readable safetensors")


# ---- 6: a RoPE graphcp would silently ignore -----------------------------------------------------
def test_case06_rope_scaling_yarn_beside_default_rope_parameters_is_refused(capsys, tmp_path, model_dir):
    d = Path(shutil.copytree(model_dir, tmp_path / "m"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 2}
    (d / "config.json").write_text(json.dumps(cfg))
    req = _requests(tmp_path, [{"tokens": [1, 2, 3]}])
    out = tmp_path / "o.pt"
    one_line_error(capsys, _prefill(d, req, out), match=r"rope_scaling and rope_parameters disagree .*rope_type")
    assert not out.exists()
    # (YaRN itself is implemented and checked against transformers in test_rope_scaling.py)


# ---- 7: tune with huge lengths ------------------------------------------------------------------
@pytest.mark.parametrize(
    "line", [{"extend": [2**63]}, {"extend": [5], "prefix": [2**63]}, {"extend": [2**62, 2**62]}],
    ids=["extend-2^63", "prefix-2^63", "sum-overflows"],
)
def test_case07_tune_huge_lengths(capsys, tmp_path, line):
    wl = _requests(tmp_path, [{"extend": [8]}, line], "w.jsonl")
    out = tmp_path / "b.json"
    one_line_error(capsys, ["tune", "--workload", wl, "--cp", "2", "--output", out], cmd="tune",
                   match=r"w\.jsonl line 2: '(extend|prefix)' lengths must be <= 2147483647")
    assert not out.exists()


# ---- 8: NaN and inf flags ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags,match",
    [
        (["--padding-factor", "nan"], r"--padding-factor must be a finite number, got nan"),
        (["--padding-factor", "inf"], r"--padding-factor must be a finite number, got inf"),
        (["--eager-penalty", "nan"], r"--eager-penalty must be a finite number, got nan"),
        (["--eager-penalty", "inf"], r"--eager-penalty must be a finite number, got inf"),
        (["--bucket-cost", "nan"], r"--bucket-cost must be a finite number, got nan"),
        (["--synthetic", "short:sigma=nan"], r"sigma must be a finite number, got nan"),
    ],
)
def test_case08_tune_nan_and_inf(capsys, tmp_path, flags, match):
    args = {"--synthetic": "short:batches=50", "--cp": "2", "--output": str(tmp_path / "b.json")}
    args.update(zip(flags[::2], flags[1::2]))
    one_line_error(capsys, ["tune", *[x for kv in args.items() for x in kv]], cmd="tune", match=match)
    assert not (tmp_path / "b.json").exists()


# ---- 9: tune with an absurd CP --------------------------------------------------------------------
def test_case09_tune_huge_cp(capsys, tmp_path):
    one_line_error(capsys, ["tune", "--synthetic", "short:batches=50", "--cp", "100000000000", "--output",
                            tmp_path / "b.json"], cmd="tune", match=r"--cp must be <= 1024, got 100000000000")


# ---- 10: --kv-tokens 0 / negative -------------------------------------------------------------------
@pytest.mark.parametrize("kv", ["0", "-16"])
def test_case10_kv_tokens_validated(capsys, tmp_path, model_dir, kv):
    req = _requests(tmp_path, [{"tokens": [1, 2, 3]}])
    one_line_error(capsys, _prefill(model_dir, req, tmp_path / "o.pt", "--kv-tokens", kv),
                   match=rf"argument --kv-tokens: expected an integer >= 1 and <= {2**31 - 1}, got '{kv}'")
    with pytest.raises(ConfigError, match="kv_tokens must be >= 1"):
        RuntimeConfig(kv_tokens=int(kv))


# ---- 11 and 12: the API ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(model_dir) -> PrefillEngine:
    return PrefillEngine(model_dir, RuntimeConfig(kv_tokens=256, page_size=16))  # 16 usable pages


def _unchanged(engine):
    return engine.parts.kv.snapshot(), engine.parts.kv.pool.clone()


def _assert_unchanged(engine, before):
    snap, pool = before
    assert engine.parts.kv.snapshot() == snap, "the allocator state changed"
    assert torch.equal(engine.parts.kv.pool, pool), "the KV pool contents changed"


def test_case11_every_refused_batch_is_a_batch_error(engine):
    t = np.arange(1, 20)
    good = [Request(np.arange(3, 40)), Request(np.arange(5, 12))]
    ref = engine.prefill(good, all_logits=True)
    for h in ref.handles:
        engine.release(h)
    held = engine.prefill([Request(np.arange(30))]).handles[0]
    bad = {
        "int prefix": [Request(t, prefix=3)],
        "list prefix": [Request(t, prefix=[1, 2])],
        "list, not a Request": [[1, 2]],
        "a Request, not a batch": Request(t),
        "ragged tokens": [Request([[1, 2], [3]])],
        "same handle twice": [Request(t, prefix=held), Request(t, prefix=held)],
        "larger than the free pool": [Request(np.arange(120)), Request(np.arange(120))],
    }
    try:
        for name, batch in bad.items():
            before = _unchanged(engine)
            with pytest.raises(BatchError):
                engine.prefill(batch)
            _assert_unchanged(engine, before)
        # the engine still computes the same logits
        again = engine.prefill(good, all_logits=True)
        for h in again.handles:
            engine.release(h)
        assert torch.equal(again.last_logits, ref.last_logits)
        assert all(torch.equal(a, b) for a, b in zip(again.logits, ref.logits))
    finally:
        engine.release(held)


def test_case12_a_handle_from_another_engine_is_refused(model_dir):
    engine, other = (PrefillEngine(model_dir, RuntimeConfig(kv_tokens=256, page_size=16)) for _ in range(2))
    mine = engine.prefill([Request(np.arange(40))]).handles[0]
    theirs = other.prefill([Request(np.arange(100, 140))]).handles[0]
    try:
        # same seq_id and token count as a live sequence here: only the issuer tells them apart
        assert (theirs.seq_id, theirs.num_tokens) == (mine.seq_id, mine.num_tokens)
        before = _unchanged(engine)
        with pytest.raises(BatchError, match=r"request 0: .*another KV cache"):
            engine.prefill([Request(np.arange(5), prefix=theirs)])
        _assert_unchanged(engine, before)
        forged = KVHandle(mine.seq_id, mine.num_tokens, mine.pages)  # no issuer: not this cache's
        with pytest.raises(BatchError):
            engine.prefill([Request(np.arange(5), prefix=forged)])
        _assert_unchanged(engine, before)
    finally:
        engine.release(mine)
        other.release(theirs)


# ---- 13: files that are not UTF-8 ---------------------------------------------------------------------
def test_case13_non_utf8_files_name_file_and_line(capsys, tmp_path, model_dir):
    req = tmp_path / "req.jsonl"
    req.write_bytes(b'{"tokens": [1, 2]}\n{"tokens": [3, \xff\xfe 4]}\n')
    one_line_error(capsys, _prefill(model_dir, req, tmp_path / "o.pt"),
                   match=r"req\.jsonl line 2: not UTF-8 text \(byte 0xff at column 16\)")
    wl = tmp_path / "w.jsonl"
    wl.write_bytes(b'{"extend": [8]}\n\n{"extend": [\xe9]}\n')
    one_line_error(capsys, ["tune", "--workload", wl, "--cp", "2", "--output", tmp_path / "b.json"], cmd="tune",
                   match=r"w\.jsonl line 3: not UTF-8 text \(byte 0xe9 at column 13\)")
