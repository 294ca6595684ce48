"""The command line's PD parts: ``graphcp prefill --export-kv DIR`` (at --cp 2 with the
layer-split cache; its pool as the --stats file reports it) and ``graphcp pd-demo`` (a round trip through Mooncake to a decode
process that continues with transformers)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from graphcp.cli.main import main
from graphcp.pd import load_kv
from graphcp.pd.mooncake import mooncake_problem


def _graphcp(capsys, *args):
    """The command in this process (its ranks and decode process are forked from it)."""
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_prefill_exports_each_request_to_a_file(hf_model_dir, tmp_path, capsys):
    folder = hf_model_dir("qwen3", False, "float32", num_hidden_layers=4)
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps({"tokens": list(range(5, 60))}) + "\n"
                    + json.dumps({"tokens": list(range(100, 130)), "prefix": 11}) + "\n")
    proc = _graphcp(capsys, "prefill", "--model", folder, "--input", reqs, "--output", tmp_path / "o.pt", "--cp", 2,
                    "--graph", "off", "--kv-cache", "layer-split", "--kv-tokens", 512, "--export-kv", tmp_path / "kv",
                    "--stats", tmp_path / "stats.json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "KV ->" in proc.stdout
    # the stats file: each rank's pool holds its 2 layers + the scratch layer, 3/4 of the
    # replicated pool (33 pages of 16 tokens, K and V, float32)
    cfg = json.loads((folder / "config.json").read_text())
    replicated = 4 * 33 * 2 * 16 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    ranks = json.loads((tmp_path / "stats.json").read_text())["ranks"]
    assert [(r["kv_cache"], r["kv_pool_bytes"]) for r in ranks] == [("layer-split", replicated * 3 // 4)] * 2
    logits = torch.load(tmp_path / "o.pt")["last_logits"]
    for i, n in enumerate((55, 30)):
        kv = load_kv(tmp_path / "kv" / f"{i}.safetensors")
        assert kv.num_tokens == n and kv.export.meta.num_layers == 4 and kv.cache.get_seq_length() == n
        assert torch.equal(kv.export.last_logits, logits[i])
        assert kv.export.token_ids.tolist() == (list(range(5, 60)) if i == 0 else list(range(100, 130)))
    bad = _graphcp(capsys, "prefill", "--model", folder, "--input", reqs, "--output", tmp_path / "o2.pt",
                   "--export-kv", tmp_path / "o.pt")
    assert bad.returncode == 2 and "--export-kv" in bad.stderr and "is a file" in bad.stderr
    assert not (tmp_path / "o2.pt").exists()


@pytest.mark.skipif(mooncake_problem() is not None, reason=f"Mooncake transport unavailable: {mooncake_problem()}")
def test_pd_demo_round_trip_matches_transformers(hf_model_dir, capsys):
    folder = hf_model_dir("llama", False, "float32")
    proc = _graphcp(capsys, "pd-demo", "--model", folder, "--graph", "off", "--kv-tokens", 1024, "--prompt-tokens", 150,
                    "--prefix-tokens", 40, "--steps", 4, "--transfer-timeout", 30)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "via mooncake" in proc.stdout and "| match" in proc.stdout and "yes |" in proc.stdout
    # the defaults: prefill at CP 4 sharded, a graphcp decode engine at CP 2 sharded imports it
    assert "CP 4, sharded cache" in proc.stdout and "TTFT" in proc.stdout
    assert "CP 2, sharded cache: imported" in proc.stdout and "(tokens a rank: 75/75)" in proc.stdout
    assert "4 steps: the first" in proc.stdout and "tokens/s" in proc.stdout


def test_pd_demo_defaults_to_the_file_transport_where_mooncake_does_not_import(hf_model_dir, capsys, monkeypatch):
    """Issue 31: the README's install has no Mooncake (the .[pd] extra and libibverbs1);
    pd-demo then goes through a file and says so, instead of refusing to run."""
    import graphcp.cli.pd_demo as pd_demo

    monkeypatch.setattr(pd_demo, "mooncake_problem", lambda: "the Mooncake transfer engine cannot be imported (test)")
    folder = hf_model_dir("llama", False, "float32")
    args = ("pd-demo", "--model", folder, "--graph", "off", "--kv-tokens", 512, "--prompt-tokens", 60,
            "--prefix-tokens", 20, "--steps", 2, "--transfer-timeout", 30, "--cp", 2, "--kv-cache", "layer-split",
            "--decode-cp", 1, "--decode-kv-cache", "replicated")
    proc = _graphcp(capsys, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "via file" in proc.stdout and "yes |" in proc.stdout
    assert [x for x in proc.stderr.splitlines() if "note:" in x] == [
        'graphcp pd-demo: note: Mooncake is not importable here, so the KV goes through a file (--transport file); '
        'for Mooncake: pip install -e ".[pd]" (and, on CPU machines, apt-get install libibverbs1)']
    asked = _graphcp(capsys, *args, "--transport", "mooncake")  # asked for by name: refused, saying how
    assert asked.returncode == 2 and asked.stderr.startswith("graphcp pd-demo: error: --transport mooncake: ")


def test_pd_demo_reference_takes_an_end_of_sequence_id_like_the_decode_side(tmp_path):
    """transformers' reference continuation is plain argmax, as the decode side's: with
    min_new_tokens it banned the end-of-sequence id, and a continuation that reached it
    (now that the presets' greedy tokens vary) read as a mismatch."""
    from graphcp.cli.pd_demo import _prompt, _reference
    from graphcp.model.presets import PRESETS, ensure_preset, ensure_random_model

    prompt = _prompt(PRESETS["default"]["vocab_size"], 20)
    first = _reference(ensure_preset("default", root=tmp_path), prompt, 0)[0]
    # the same weights, the greedy first token now the end-of-sequence id
    folder = ensure_random_model("default-eos", {**PRESETS["default"], "eos_token_id": first}, root=tmp_path)
    assert _reference(folder, prompt, 2)[0] == first


def test_pd_demo_continues_with_transformers_a_model_graphcp_does_not_import(hf_model_dir, capsys):
    """A DeepSeek V4 model (its export holds transformers' pooled state, which graphcp's
    cache cannot take back): the decode side is transformers, from the graphcp-dsv4/1
    export, and the demo says so on stderr."""
    folder = hf_model_dir("deepseek_v4", False, "float32")
    proc = _graphcp(capsys, "pd-demo", "--model", folder, "--graph", "off", "--kv-tokens", 512, "--prompt-tokens", 40,
                    "--prefix-tokens", 12, "--steps", 2, "--transfer-timeout", 30, "--cp", 2, "--kv-cache",
                    "layer-split", "--transport", "file")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "the decode side continues with transformers" in proc.stderr
    assert "| decode             | transformers:" in proc.stdout and "yes |" in proc.stdout


def test_pd_demo_decodes_a_dsa_model_on_the_nearest_cache_it_decodes_on(hf_model_dir, capsys):
    """A DSA model does not decode on the default token-sharded cache: the decode side is
    graphcp on the layer-split cache, and the demo says which."""
    folder = hf_model_dir("deepseek_v32", False, "float32")
    proc = _graphcp(capsys, "pd-demo", "--model", folder, "--graph", "off", "--kv-tokens", 512, "--prompt-tokens", 40,
                    "--prefix-tokens", 12, "--steps", 2, "--transfer-timeout", 30, "--cp", 2, "--kv-cache",
                    "layer-split", "--transport", "file")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "the decode side uses --decode-kv-cache layer-split" in proc.stderr
    assert "continues with transformers" not in proc.stderr and "yes |" in proc.stdout
