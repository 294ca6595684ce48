"""Generated bad inputs for the command line (a seeded generator: the same cases every
run). Each case must end with exit code 2 and exactly one stderr line
``graphcp CMD: error: ...`` that names what is wrong (the file and line, the key, the
flag), no traceback, and no output written: a missing OUT stays missing, an old one
keeps its bytes.

Most cases run in-process through ``graphcp.cli.main`` (a subprocess costs seconds);
four run as real processes, one of them at ``--cp 2``. Counts: request files 51,
engine-level requests 12 (2 at CP 2), config.json 47, checkpoints 10, prefill flags
29, bucket files 16, tune 53: 218 in-process (each category asserts its minimum).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from graphcp.cli.main import main

VOCAB = 512  # conftest.py's tiny checkpoints: 4096 positions, intermediate 128
SEED = 1313
OLD_BYTES = b"an older OUT file that a failed run must leave alone\n"


@dataclass
class Case:
    name: str
    argv: list
    expect: str  # regex the one stderr line must match
    cmd: str = "prefill"
    out: Path | None = None  # the output the run must not write


@pytest.fixture(scope="module")
def model_dir(hf_model_dir) -> Path:
    return hf_model_dir("qwen2", False, "float32")


def _run(case: Case, capsys, rng: random.Random) -> str | None:
    """None when the case holds, else what went wrong."""
    old = case.out is not None and rng.random() < 0.5
    if old:
        case.out.write_bytes(OLD_BYTES)
    elif case.out is not None and case.out.exists():
        case.out.unlink()
    try:
        code = main([str(a) for a in case.argv])
    except SystemExit as e:  # argparse refused a flag's value (its range): the same contract
        code = e.code
    err = capsys.readouterr().err
    lines = err.splitlines()
    if code != 2:
        return f"exit {code}: {err!r}"
    if len(lines) != 1 or not err.endswith("\n"):
        return f"{len(lines)} stderr lines: {err!r}"
    if not lines[0].startswith(f"graphcp {case.cmd}: error: ") or "Traceback" in err:
        return f"not a one-line error: {err!r}"
    if not re.search(case.expect, lines[0]):
        return f"{lines[0]!r} does not match {case.expect!r}"
    if case.out is not None:
        if old and case.out.read_bytes() != OLD_BYTES:
            return "the old output file was changed"
        if not old and case.out.exists():
            return "an output file was written"
    return None


def _check_all(cases: list[Case], capsys, minimum: int) -> None:
    assert len(cases) >= minimum, len(cases)
    rng = random.Random(SEED)
    bad = [f"{c.name}: {why}" for c in cases if (why := _run(c, capsys, rng)) is not None]
    assert not bad, f"{len(bad)} of {len(cases)} cases broke the contract:\n" + "\n".join(bad)


def _dump(value) -> str:
    return json.dumps(value)  # NaN / Infinity as the JSON extensions Python reads back


# ---- REQUESTS.jsonl --------------------------------------------------------------------------
def _bad_request_lines(rng: random.Random) -> list[tuple[str, bytes, str]]:
    """(name, the bad line's bytes, what the message must say after 'line N: ')."""
    toks = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 9))]
    good = json.dumps({"tokens": toks})
    out = []
    for _ in range(6):  # truncated JSON
        cut = rng.randrange(1, len(good) - 1)
        out.append((f"truncated@{cut}", good[:cut].encode(), r"not valid JSON"))
    for v in (3, "x", None, [1, 2], True, 2.5):
        out.append((f"not-an-object-{v!r}", _dump(v).encode(), r"expected an object"))
    for el in (1.5, "7", True, [1], None, {"id": 1}, float("nan")):
        bad = list(toks)
        bad[rng.randrange(len(bad))] = el
        out.append((f"token-{el!r}", _dump({"tokens": bad}).encode(), r'"tokens" must be a list of integer ids'))
    for v in ("abc", 5, None, {}, 1e3):
        out.append((f"tokens-{v!r}", _dump({"tokens": v}).encode(), r'"tokens" must be a list of integer ids'))
    out.append(("no-tokens", b'{"prefix": 1}', r'expected an object with "tokens"'))
    out.append(("empty-tokens", b'{"tokens": []}', r"empty request"))
    for v in (2**64, -(2**64), 2**63):
        bad = list(toks)
        bad[rng.randrange(len(bad))] = v
        out.append((f"id-{v}", _dump({"tokens": bad}).encode(), r"does not fit 64 bits"))
    out.append(("id-1000-digits", b'{"tokens": [1, ' + b"9" * 1000 + b"]}", r"not valid JSON \(ValueError"))
    for v in (-1, 1.5, "2", True, None, [1]):
        out.append((f"prefix-{v!r}", _dump({"tokens": toks, "prefix": v}).encode(), r'"prefix" must be an integer'))
    for v in (len(toks), len(toks) + rng.randrange(1, 100), 2**70):
        out.append((f"prefix-{v}", _dump({"tokens": toks, "prefix": v}).encode(), r"is not shorter than the request"))
    for key in ("prefx", "token", "extend"):
        out.append((f"key-{key}", _dump({"tokens": toks, key: 1}).encode(), r"unknown keys"))
    for b in (b"\xff", b"\xc3", b"\xe9", b"\x80\x80", b"\xed\xa0\x80"):  # invalid starts, truncated, surrogate
        pos = rng.randrange(len(good))
        out.append((f"bytes-{b!r}@{pos}", good[:pos].encode() + b + good[pos:].encode(), r"not UTF-8 text"))
    out.append(("deep-nesting", b"[" * 100000 + b"]" * 100000, r"not valid JSON"))
    return out


def test_generated_request_files(capsys, tmp_path, model_dir):
    rng = random.Random(SEED)
    cases = []
    for i, (name, line, expect) in enumerate(_bad_request_lines(rng)):
        n_good = rng.randrange(0, 4)
        at = rng.randrange(n_good + 1)
        lines = [json.dumps({"tokens": [rng.randrange(VOCAB) for _ in range(3)]}).encode() for _ in range(n_good)]
        lines.insert(at, line)
        req = tmp_path / f"r{i}.jsonl"
        req.write_bytes(b"\n".join(lines) + b"\n")
        out = tmp_path / f"o{i}.pt"
        cases.append(Case(name, ["prefill", "--model", model_dir, "--input", req, "--output", out],
                          rf"r{i}\.jsonl line {at + 1}: .*{expect}", out=out))
    for i, text in enumerate([b"", b"\n\n  \n", b"\xef\xbb\xbf\n"]):  # empty, blank, only a BOM
        req = tmp_path / f"e{i}.jsonl"
        req.write_bytes(text)
        cases.append(Case(f"empty-{i}", ["prefill", "--model", model_dir, "--input", req, "--output",
                                         tmp_path / "o.pt"], r"no requests \(empty batch\)", out=tmp_path / "o.pt"))
    _check_all(cases, capsys, minimum=50)


def test_generated_engine_level_requests(capsys, tmp_path, model_dir):
    """Requests that parse but the engine refuses (vocabulary, context, pool), at CP 1
    and, for two of them, CP 2 (one stderr line: the rank's own message)."""
    rng = random.Random(SEED + 1)
    cases = []
    for i in range(8):
        n = rng.randrange(1, 40)
        toks = [rng.randrange(VOCAB) for _ in range(n)]
        pos = rng.randrange(n)
        toks[pos] = rng.choice([VOCAB, VOCAB + rng.randrange(1, 10**6), -1, -rng.randrange(2, 2**40), 2**62])
        reqs = [{"tokens": [1, 2]}] * (i % 3) + [{"tokens": toks}]
        req = tmp_path / f"v{i}.jsonl"
        req.write_text("".join(json.dumps(r) + "\n" for r in reqs))
        cp = ["--cp", "2"] if i < 1 else []
        cases.append(Case(f"vocab-{i}", ["prefill", "--model", model_dir, "--input", req, "--output",
                                         tmp_path / f"v{i}.pt", "--graph", "off", *cp],
                          rf"v{i}.jsonl line {i % 3 + 1}, position {pos}: token id {toks[pos]} is outside the vocabulary",
                          out=tmp_path / f"v{i}.pt"))
    ctx = tmp_path / "ctx.jsonl"
    ctx.write_text(json.dumps({"tokens": [5] * 4097}) + "\n")
    cases.append(Case("context", ["prefill", "--model", model_dir, "--input", ctx, "--output", tmp_path / "c.pt"],
                      r"ctx.jsonl line 1: 4097 prompt tokens exceed the model's context of 4096",
                      out=tmp_path / "c.pt"))
    pool = tmp_path / "pool.jsonl"
    pool.write_text(json.dumps({"tokens": [5] * 100}) + "\n")
    cases.append(Case("pool", ["prefill", "--model", model_dir, "--input", pool, "--output", tmp_path / "p.pt",
                               "--kv-tokens", "64"], r"100 tokens exceed the KV pool of 64", out=tmp_path / "p.pt"))
    full = tmp_path / "full.jsonl"
    full.write_text((json.dumps({"tokens": [5] * 40}) + "\n") * 3)
    for cp in ([], ["--cp", "2"]):
        cases.append(Case(f"kv-full{cp}", ["prefill", "--model", model_dir, "--input", full, "--output",
                                           tmp_path / "f.pt", "--kv-tokens", "96", "--graph", "off", *cp],
                          r"KV cache full: the batch needs 9 more pages of 16 tokens, 6 are free",
                          out=tmp_path / "f.pt"))
    _check_all(cases, capsys, minimum=12)


# ---- config.json -------------------------------------------------------------------------------
INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings")
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
BAD_INTS = ("x", 1.5, True, -1, 0, 2**40, [], {}, float("nan"), 64.0)
BAD = {
    "rms_norm_eps": ("x", -1.0, 2.0, float("nan"), float("inf"), True, []),
    "tie_word_embeddings": ("yes", 1, 0.0, []),
    "attention_bias": ("no", 2, {}),
    "mlp_bias": ("true", 1),
    "rope_theta": ("x", -5, 0, 0.5, float("nan"), float("inf"), True),
    "rope_parameters": ("default", 5, [1], {"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "foo"},
                        {"rope_type": "yarn"}, {"rope_type": "linear", "factor": "2"},
                        {"rope_type": "yarn", "factor": 2.0, "bogus": 1}, {"rope_type": "default", "rope_theta": -1}),
    "rope_scaling": ({"rope_type": "yarn", "factor": 2.0}, "linear", {"type": "dynamic", "factor": 4}),
    "architectures": ("Qwen2ForCausalLM", [5], ["GPT2LMHeadModel"], {}),
    "hidden_act": ("gelu", 5, None),
    "torch_dtype": (5, [], {}),
    "sliding_window": ("x", -1, 1.5),
    "partial_rotary_factor": (0.5, "half"),
}


def test_generated_config_json(capsys, tmp_path, model_dir):
    rng = random.Random(SEED + 2)
    d = Path(shutil.copytree(model_dir, tmp_path / "m"))
    base = json.loads((model_dir / "config.json").read_text())
    base.pop("dtype", None)  # config.json may say dtype or torch_dtype: keep one, the one the cases edit
    base["torch_dtype"] = "float32"
    req = tmp_path / "r.jsonl"
    req.write_text('{"tokens": [1, 2, 3]}\n')
    combos = [(k, v) for k in INT_KEYS for v in BAD_INTS] + [(k, None) for k in REQUIRED]
    combos += [(k, v) for k, vs in BAD.items() for v in vs]
    picked = [combos[i] for i in sorted(rng.sample(range(len(combos)), 40))] + [(k, v) for k, v in combos[-5:]]
    cases = []
    for i, (key, value) in enumerate(picked):
        cfg = dict(base)
        cfg[key] = value
        path = d / f"c{i}"
        path.mkdir()
        for f in d.glob("*.safetensors"):
            os.link(f, path / f.name)
        (path / "config.json").write_text(_dump(cfg))
        cases.append(Case(f"{key}={value!r}", ["prefill", "--model", path, "--input", req, "--output",
                                                tmp_path / "o.pt"], rf"c{i}/config\.json: .*{key}",
                          out=tmp_path / "o.pt"))
    cases.append(Case("not-json", ["prefill", "--model", _with_config(tmp_path / "nj", d, b"{"), "--input", req,
                                   "--output", tmp_path / "o.pt"], r"config\.json: not valid JSON", out=tmp_path / "o.pt"))
    cases.append(Case("not-utf8", ["prefill", "--model", _with_config(tmp_path / "nu", d, b'{"a": "\xff"}'),
                                   "--input", req, "--output", tmp_path / "o.pt"], r"config\.json: not UTF-8",
                      out=tmp_path / "o.pt"))
    _check_all(cases, capsys, minimum=45)


def _with_config(folder: Path, weights_from: Path, config: bytes) -> Path:
    folder.mkdir()
    (folder / "config.json").write_bytes(config)
    for f in weights_from.glob("*.safetensors"):
        os.link(f, folder / f.name)
    return folder


# ---- checkpoints -------------------------------------------------------------------------------
def test_generated_corrupt_checkpoints(capsys, tmp_path, model_dir):
    rng = random.Random(SEED + 3)
    data = (model_dir / "model.safetensors").read_bytes()
    header = int.from_bytes(data[:8], "little")
    blobs = {
        "empty": b"", "7-bytes": data[:7], "header-cut": data[: 8 + rng.randrange(1, header)],
        "data-cut": data[: rng.randrange(8 + header + 1, len(data) - 1)], "one-byte-short": data[:-1],
        "garbage": rng.randbytes(rng.randrange(16, 5000)), "huge-header-length": (2**62).to_bytes(8, "little") + data[8:],
        "header-not-json": data[:8] + b"#" * header + data[8 + header:], "trailing-bytes": data + b"\0" * 13,
        "zero-length-header": (0).to_bytes(8, "little") + data[8:],
    }
    req = tmp_path / "r.jsonl"
    req.write_text('{"tokens": [1, 2, 3]}\n')
    cases = []
    for name, blob in blobs.items():
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(model_dir / "config.json", folder / "config.json")
        (folder / "model.safetensors").write_bytes(blob)
        cases.append(Case(name, ["prefill", "--model", folder, "--input", req, "--output", tmp_path / "o.pt"],
                          rf"{name}/model\.safetensors: not a readable safetensors file", out=tmp_path / "o.pt"))
    _check_all(cases, capsys, minimum=10)


# ---- prefill flags and bucket files ----------------------------------------------------------------
def test_generated_prefill_flags(capsys, tmp_path, model_dir):
    req = tmp_path / "r.jsonl"
    req.write_text('{"tokens": [1, 2, 3]}\n')
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "o.pt"
    flags = [
        (["--kv-tokens", v], rf"argument --kv-tokens: expected an integer >= 1 and <= 2147483647, got '{v}'")
        for v in ("0", "-1", "-16", str(2**31), str(2**40))
    ] + [
        (["--kv-tokens", str(2**31 - 1)], r"--cp 1: 1 rank needs about .* GiB \(a rank, estimated, .* kv pool 1024\.00"),
        (["--kv-tokens", str(2**31 - 1), "--no-memory-check"],
         r"kv_tokens=2147483647: a KV pool of .* tokens needs .* GiB, more than"),
    ] + [
        (["--page-size", v], r"argument --page-size: expected an integer >= 1 and <= 4096") for v in ("0", "-1", "5000", str(10**9))
    ] + [
        (["--max-requests", v], r"argument --max-requests: expected an integer") for v in ("0", "-5", str(10**6))
    ] + [
        (["--timeout", v], r"argument --timeout: expected a number > 0") for v in ("nan", "inf", "-1", "0")
    ] + [
        (["--cp", v], r"argument --cp: expected an integer >= 1 and <= 1024") for v in ("0", "-1", "2000")
    ] + [
        (["--cp", v], r"intermediate_size=128 does not divide by --cp " + v) for v in ("3", "5", "256")
    ] + [
        (["--model", tmp_path / "no-such-model"], r"--model .* is neither a preset"),
        (["--model", tmp_path / "a-file"], r"--model .* is neither a preset"),
    ]
    cases = [Case(f"{f[0]}={f[1]}", ["prefill", "--model", model_dir, "--input", req, "--output", out, *f], e, out=out)
             for f, e in flags]
    cases += [
        Case("output-missing-folder", ["prefill", "--model", model_dir, "--input", req, "--output",
                                       tmp_path / "x" / "o.pt"], r"--output .* folder .* does not exist"),
        Case("output-is-a-folder", ["prefill", "--model", model_dir, "--input", req, "--output", tmp_path],
             r"--output .* is a folder"),
        Case("input-missing", ["prefill", "--model", model_dir, "--input", tmp_path / "nope.jsonl", "--output", out],
             r"cannot read request file .*nope\.jsonl", out=out),
        Case("input-is-a-folder", ["prefill", "--model", model_dir, "--input", tmp_path, "--output", out],
             r"cannot read request file", out=out),
    ]
    _check_all(cases, capsys, minimum=24)


def test_generated_bucket_files(capsys, tmp_path, model_dir):
    req = tmp_path / "r.jsonl"
    req.write_text('{"tokens": [1, 2, 3]}\n')
    good = {"version": 1, "capacities": [16, 32], "align": 8, "padding_factor": 2.0}
    files = {
        "list": b"[16, 32]", "number": b"16", "string": b'"16,32"', "null": b"null", "not-json": b"{",
        "not-utf8": b'{"version": 1, "capacities": [16], "x": "\xff"}', "missing": None,
        "no-capacities": _dump({"version": 1}).encode(), "version-2": _dump({**good, "version": 2}).encode(),
        "capacities-str": _dump({**good, "capacities": ["16"]}).encode(),
        "capacities-empty": _dump({**good, "capacities": []}).encode(),
        "capacities-huge": _dump({**good, "capacities": [2**40]}).encode(),
        "align-12": _dump({**good, "align": 12}).encode(),
        "padding-nan": _dump({**good, "padding_factor": float("nan")}).encode(),
        "layout-bogus": _dump({**good, "layout": "spiral"}).encode(),
        "tuned-for-cp4": _dump({**good, "cp_size": 4}).encode(),
    }
    cases = []
    for name, blob in files.items():
        b = tmp_path / f"{name}.json"
        if blob is not None:
            b.write_bytes(blob)
        cases.append(Case(name, ["prefill", "--model", model_dir, "--input", req, "--output", tmp_path / "o.pt",
                                 "--buckets", b], r"bucket file", out=tmp_path / "o.pt"))
    _check_all(cases, capsys, minimum=16)


# ---- graphcp tune --------------------------------------------------------------------------------------
def test_generated_tune(capsys, tmp_path):
    rng = random.Random(SEED + 4)
    out = tmp_path / "b.json"
    base = ["tune", "--output", out]
    cases = []
    bad_lines = [
        (b'{"extend": [4, 0]}', r"'extend' lengths must be positive"),
        (b'{"extend": [-3]}', r"'extend' lengths must be positive"),
        (_dump({"extend": [2**31]}).encode(), r"lengths must be <= 2147483647"),
        (_dump({"extend": [2**63]}).encode(), r"lengths must be <= 2147483647"),
        (_dump({"extend": [2**62, 2**62]}).encode(), r"lengths must be <= 2147483647"),
        (_dump({"extend": [5], "prefix": [2**63]}).encode(), r"'prefix' lengths must be <= 2147483647"),
        (_dump({"extend": [5], "prefix": [-1]}).encode(), r"'prefix' lengths must be non-negative"),
        (_dump({"extend": [5, 6], "prefix": [1]}).encode(), r"'prefix' has 1 entries but 'extend' has 2"),
        (b'{"extend": [1.5]}', r"must hold integers"),
        (b'{"extend": [true]}', r"must hold integers"),
        (b'{"extend": "8"}', r"must be a non-empty list"),
        (b'{"extend": []}', r"must be a non-empty list"),
        (b'{"extend": [1], "lens": [2]}', r"unknown keys"),
        (b'{"prefix": [1]}', r"missing 'extend'"),
        (b"[1, 2]", r"expected a JSON object"),
        (b'{"extend": [1,', r"not valid JSON"),
        (b'{"extend": [NaN]}', r"must hold integers"),
        (b'{"extend": [\xff]}', r"not UTF-8 text"),
    ]
    for i, (line, expect) in enumerate(bad_lines):
        n_good = rng.randrange(0, 3)
        wl = tmp_path / f"w{i}.jsonl"
        wl.write_bytes(b'{"extend": [8]}\n' * n_good + line + b"\n")
        cases.append(Case(f"line-{line[:30]!r}", base + ["--workload", wl, "--cp", "2"],
                          rf"w{i}\.jsonl line {n_good + 1}: .*{expect}", cmd="tune", out=out))
    flags = [
        ("--padding-factor", "nan", "finite"), ("--padding-factor", "inf", "finite"), ("--padding-factor", "-inf", "finite"),
        ("--padding-factor", "0.5", ">= 1"), ("--padding-factor", "1e9", "<="), ("--eager-penalty", "nan", "finite"),
        ("--eager-penalty", "inf", "finite"), ("--eager-penalty", "1.0", ">= --padding-factor"),
        ("--bucket-cost", "nan", "finite"), ("--bucket-cost", "inf", "finite"), ("--bucket-cost", "-1", ">= 0"),
        ("--cp", "0", ">= 1"), ("--cp", "-3", ">= 1"), ("--cp", str(10**11), "<= 1024"), ("--align", "12", "multiple of 8"),
        ("--align", "0", ">= 8"), ("--align", str(2**20), "<="), ("--max-buckets", "0", ">= 1"),
        ("--max-buckets", str(10**6), "<="), ("--max-capacity", "4", ">= --align"), ("--max-capacity", str(2**30), "<="),
        ("--seed", "-1", ">= 0"), ("--seed", str(2**64), "<="),
    ]
    for flag, value, expect in flags:
        argv = {"--synthetic": "short:batches=20", "--cp": "2", flag: value}
        # --flag=value: argparse would read "-inf" as an option
        cases.append(Case(f"{flag}={value}", base + [f"{k}={v}" for k, v in argv.items()],
                          rf"{re.escape(flag)} must .*{re.escape(expect)}", cmd="tune", out=out))
    specs = [("short:sigma=nan", "sigma"), ("short:hit=inf", "hit"), ("longctx:load=-1", "load"),
             ("chunked:chunk=0", "chunk"), ("short:batches=99999999999999", "batches"), ("short:median=1e400", "median"),
             ("longctx:budget=2000000000,median=1", "requests in all"), ("short:reqs=nan", "reqs"),
             ("nope", "unknown synthetic workload"), ("short:x=1", "unknown parameter")]
    for spec, expect in specs:
        cases.append(Case(f"spec-{spec}", base + ["--synthetic", spec, "--cp", "2"], rf"{re.escape(expect)}", cmd="tune",
                          out=out))
    for flag in ("--plot", "--report-json"):
        cases.append(Case(f"{flag}-unwritable", base + ["--synthetic", "short:batches=20", "--cp", "2", flag,
                                                         tmp_path / "no" / "x"], rf"{flag} .* does not exist",
                          cmd="tune", out=out))
    _check_all(cases, capsys, minimum=45)


def test_usage_errors_are_one_line_too(capsys, tmp_path):
    """argparse's own errors (unparsable values, unknown or missing flags) keep the
    contract: exit code 2, one line."""
    for argv in (["prefill", "--input", "r", "--output", "o", "--kv-tokens", "abc"],
                 ["prefill", "--input", "r", "--output", "o", "--cp", "1.5"],
                 ["prefill", "--input", "r"], ["prefill", "--input", "r", "--output", "o", "--dtype", "float64"],
                 ["prefill", "--input", "r", "--output", "o", "--no-such-flag"],
                 ["tune", "--synthetic", "short", "--cp", "two", "--output", "o"], ["launch-rockets"], []):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.splitlines()) == 1 and "error: " in err, (argv, err)
        assert "--help" in err


# ---- real processes -------------------------------------------------------------------------------------
def test_subprocess_runs_print_one_line(tmp_path, model_dir):
    """The installed entry point behaves as main() does, at CP 1 and CP 2, and a
    traceback appears only with GRAPHCP_DEBUG=1 (at CP 2 in test_error_contract.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GRAPHCP_DEBUG", None)
    req = tmp_path / "r.jsonl"
    req.write_text(json.dumps({"tokens": [1, VOCAB + 1]}) + "\n")
    out = tmp_path / "o.pt"
    runs = [
        (["prefill", "--model", model_dir, "--input", req, "--output", out], r"position 1: token id 513", {}),
        (["prefill", "--model", model_dir, "--input", req, "--output", out, "--cp", "2"], r"position 1: token id 513",
         {}),
        (["tune", "--synthetic", "short:batches=20", "--cp", "2", "--padding-factor", "nan", "--output",
          tmp_path / "b.json"], r"--padding-factor must be a finite number", {}),
    ]
    # the processes run at once (each spends most of its time importing torch)
    procs = [subprocess.Popen([sys.executable, "-m", "graphcp", *map(str, argv)], env={**env, **extra},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv, _, extra in runs + [(runs[0][0], None, {"GRAPHCP_DEBUG": "1"})]]
    done = [(proc, *proc.communicate(timeout=120)) for proc in procs]
    for (proc, _, err), (_, expect, _) in zip(done, runs):
        assert proc.returncode == 2, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert re.search(expect, err), err
    assert not out.exists()
    p, _, err = done[-1]
    assert p.returncode == 2 and "Traceback" in err and "BatchError" in err, err
    assert re.search(r"^graphcp prefill: error: \S*r.jsonl line 1, position 1: token id 513", err.splitlines()[-1])


def test_a_bug_is_not_reported_as_bad_input(capsys, tmp_path, model_dir, monkeypatch):
    """Anything that is not graphcp's own error surfaces (exit 1 with a traceback from
    the interpreter), instead of being dressed up as a user error."""
    import graphcp.cli.inputs

    def broken(path):
        return 1 / 0

    monkeypatch.setattr(graphcp.cli.inputs, "parse_requests", broken)
    req = tmp_path / "r.jsonl"
    req.write_text('{"tokens": [1]}\n')
    with pytest.raises(ZeroDivisionError):
        main(["prefill", "--model", str(model_dir), "--input", str(req), "--output", str(tmp_path / "o.pt")])


def test_a_bug_in_a_rank_surfaces_with_its_traceback(capsys, tmp_path, model_dir, monkeypatch):
    """At --cp 2 a rank's bug is re-raised (RankFailure flagged rank_bug), with the
    rank's traceback on stderr: not a one-line 'bad input'."""
    import graphcp.cli.jobs
    from graphcp.dist import RankFailure

    def broken(engine, reqs, all_logits):
        return {}["no such key"]

    monkeypatch.setattr(graphcp.cli.jobs, "prefill_requests", broken)  # fork: the ranks see it too
    req = tmp_path / "r.jsonl"
    req.write_text('{"tokens": [1]}\n')
    with pytest.raises(RankFailure) as e:
        main(["prefill", "--model", str(model_dir), "--input", str(req), "--output", str(tmp_path / "o.pt"),
              "--cp", "2", "--graph", "off"])
    assert e.value.rank_bug and "KeyError" in str(e.value) and len(str(e.value).splitlines()) == 1
    err = capsys.readouterr().err
    assert "--- rank " in err and "Traceback" in err and "in broken" in err
