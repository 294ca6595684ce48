"""What ``engine.import_kv`` and ``graphcp generate --import-kv`` refuse (docs/pd.md,
"Import: what can go wrong"): a truncated file, a payload of another model, a format
version from the future, another dtype, an import into a full pool, each one line with
the cache unchanged; the pairs combinations.py declares refused (DeepSeek V4, an
EAGLE-3 draft); the command line end to end (prefill at CP 2 layer-split, its files
continued at CP 2 sharded equal to graphcp's own generate), and its bad folders."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.cli.main import main
from graphcp.combinations import REFUSALS
from graphcp.errors import ConfigError, InputError
from graphcp.kv.handle import KVCacheFull
from graphcp.pd.errors import KVImportError
from graphcp.pd.export import KVFormatError
from graphcp.pd.files import save_kv

LEN = 45


def _engine(folder, dtype: str = "float32", kv_tokens: int = 1024, mode: str = "replicated") -> PrefillEngine:
    return PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=kv_tokens, page_size=16, kv_cache=mode))


def _export(folder, dtype: str = "float32"):
    eng = _engine(folder, dtype)
    toks = np.random.default_rng(1).integers(0, eng.cfg.vocab_size, LEN)
    out = eng.prefill([Request(toks)])
    e = eng.export_kv(out.handles[0])
    e.token_ids, e.last_logits = torch.from_numpy(toks), out.last_logits[0]
    return e


@pytest.fixture(scope="module")
def dense(hf_model_dir):
    return hf_model_dir("qwen3", False, "float32")


@pytest.fixture(scope="module")
def export(dense):
    return _export(dense)


def _refused(eng: PrefillEngine, payload, err: type) -> str:
    """The refusal's line; the cache exactly as before."""
    before = eng.parts.kv.snapshot()
    with pytest.raises(err) as e:
        eng.import_kv(payload)
    assert eng.parts.kv.snapshot() == before
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_bad_payloads_are_one_line_and_change_nothing(dense, export, hf_model_dir, tmp_path):
    eng = _engine(dense, mode="sharded")
    kept = eng.import_kv(export)  # a live request: the refusals must leave it as it is
    path = save_kv(export, tmp_path / "0.safetensors")
    data = path.read_bytes()
    # a truncated file
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    assert str(cut) in _refused(eng, cut, KVFormatError)
    # a format version from the future
    with safe_open(str(path), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    future = tmp_path / "future.safetensors"
    save_file(tensors, str(future), metadata={**header, "format": "graphcp-kv/2"})
    assert "graphcp-kv/2" in _refused(eng, future, KVFormatError)
    # a payload of another model (same shapes, another config: another fingerprint)
    other = _export(hf_model_dir("qwen3", False, "float32", rms_norm_eps=1e-5))
    assert "another model" in _refused(eng, other, KVImportError)
    # another dtype
    bf16 = _export(dense, "bfloat16")  # (the same checkpoint run in bfloat16)
    assert bf16.meta.fingerprint == export.meta.fingerprint
    assert "bfloat16" in _refused(eng, bf16, KVImportError)
    # not an export at all
    assert "expected a KV export" in _refused(eng, {"k": []}, KVImportError)
    # the live request is intact: its export is the payload's
    again = eng.export_kv(kept)
    assert all(torch.equal(a, b) for a, b in zip(again.k + again.v, export.k + export.v))


def test_an_import_into_a_full_pool_is_kv_cache_full_with_nothing_changed(dense, export):
    eng = _engine(dense, kv_tokens=64)  # 4 pages of 16: one 45-token request
    eng.import_kv(export)
    msg = _refused(eng, export, KVCacheFull)
    assert "KV cache full" in msg and "kv_tokens" in msg


def test_refused_pairs_name_their_reason(dense, hf_model_dir, export):
    """combinations.py's import refusals, from a live engine (before the payload is read)."""
    v4 = PrefillEngine(hf_model_dir("deepseek_v4", False, "float32"), RuntimeConfig(kv_tokens=256))
    rule = next(r for r in REFUSALS if r.a == ("model", ("dsv4",)) and r.b[0] == "import")
    with pytest.raises(ConfigError) as e:
        v4.import_kv(export)
    assert rule.reason in str(e.value) and "PrefillEngine.import_kv" in str(e.value) and "\n" not in str(e.value)
    assert not any(r.reason.endswith("not built yet") for r in REFUSALS if "import" in (r.a[0], r.b[0]))


def test_generate_import_kv_continues_another_shapes_files(default_model_dir, tmp_path, capsys):
    req = tmp_path / "req.jsonl"
    rng = np.random.default_rng(4)
    lines = [{"tokens": rng.integers(0, 8000, 30).tolist(), "prefix": 12}, {"tokens": rng.integers(0, 8000, 9).tolist()}]
    req.write_text("".join(json.dumps(x) + "\n" for x in lines))
    common = ["--model", str(default_model_dir), "--kv-tokens", "1024"]
    assert main(["prefill", "--input", str(req), "--output", str(tmp_path / "p.pt"), "--cp", "2", "--kv-cache",
                 "layer-split", "--export-kv", str(tmp_path / "kv"), *common]) == 0
    assert main(["generate", "--import-kv", str(tmp_path / "kv"), "--output", str(tmp_path / "g.pt"),
                 "--max-new-tokens", "6", "--cp", "2", "--kv-cache", "sharded", "--save-logits", *common]) == 0
    assert main(["generate", "--input", str(req), "--output", str(tmp_path / "ref.pt"), "--max-new-tokens", "6",
                 "--save-logits", *common]) == 0
    got, ref = torch.load(tmp_path / "g.pt"), torch.load(tmp_path / "ref.pt")
    assert got["tokens"] == ref["tokens"] and got["finish"] == ref["finish"]
    for a, b in zip(got["logits"], ref["logits"]):
        assert (a[0] - b[0]).abs().max() <= 1e-4 * b[0].abs().max()
    # bad folders and files: one line, exit 2, before any rank starts
    (tmp_path / "empty").mkdir()
    (tmp_path / "kv" / "1.safetensors").write_bytes(b"not a file")
    capsys.readouterr()
    for argv, says in (
        (["--import-kv", str(tmp_path / "empty")], "no <i>.safetensors"),
        (["--import-kv", str(tmp_path / "kv")], "1.safetensors"),
        (["--import-kv", str(tmp_path / "kv"), "--input", str(req)], "exactly one"),
    ):
        code = main(["generate", *argv, "--output", str(tmp_path / "x.pt"), "--max-new-tokens", "2", *common])
        err = capsys.readouterr().err
        assert code == 2 and len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "x.pt").exists()


def test_import_error_is_an_input_error():
    assert issubclass(KVImportError, InputError)


def _different_payloads(group, folder, payloads):
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, page_size=16, kv_cache="sharded"), group)
    before = eng.parts.kv.snapshot()
    try:
        eng.import_kv(payloads[group.rank])
        return None
    except Exception as e:  # noqa: BLE001 - the test reads it
        return type(e).__name__, str(e), eng.parts.kv.snapshot() == before


def test_ranks_given_different_payloads_refuse_on_every_rank(dense, export):
    """SPMD: every rank must be given the same payload; a rank given another refuses on
    every rank, one line, nothing reserved (the ledger every rank keeps stays the same)."""
    from graphcp.dist import launch

    other = _export(dense)
    other.token_ids = other.token_ids.flip(0)  # another request's tokens, the same length
    for name, msg, unchanged in launch(_different_payloads, 2, dense, [export, other]):
        assert name == "ConsistencyError" and "another payload to import_kv" in msg and "\n" not in msg, msg
        assert unchanged


def test_a_kv_file_is_read_in_parts(export, tmp_path):
    """What an import by path reads: the header's metadata and shapes (no tensor), then each
    rank's runs of positions, equal to the whole file's slices."""
    from graphcp.pd.files import KVFile, read_kv

    path = save_kv(export, tmp_path / "0.safetensors")
    whole, part = read_kv(path), KVFile(path).check()
    assert part.meta == whole.meta and torch.equal(part.token_ids, whole.token_ids)
    runs = [(0, 3), (17, 29), (44, 45)]
    for i, n in whole.meta.tensors():
        want = torch.cat([whole.tensor(i, n)[:, a:b] for a, b in runs], dim=1)
        assert torch.equal(part.read_runs(i, n, runs), want)
        assert part.read_runs(i, n, []).shape == whole.meta.tensor_shape(i, n, 0)
