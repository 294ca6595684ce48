"""PD export of a DSA model's cache (format graphcp-mla/1): per layer the latent, the
rope key (pairs interleaved as cached) and, for the indexer layers, the indexer key.

References: transformers' own cache after running the whole prompt (the tensors, after
undoing the documented pair permutation), and transformers continuing from the
exported cache (next-token logits for a few more tokens equal to transformers on the
whole sequence, float32 1e-4). Replicated and layer-split caches at CP 1 and 2,
float32 and bfloat16, a request extending a cached prefix (float32: past index_topk;
bfloat16: within it, as tests/test_dsa_parity.py: past it a bfloat16 rounding flips
near-tied top-k choices in either implementation, so later layers' caches differ); the two
caches' exports at CP 2 are bitwise equal; files round trip; the Mooncake transport
carries the format; malformed metadata is refused with a message naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import save_cases
from helpers import rel_err, send_export
from safetensors import safe_open
from safetensors.torch import save_file

from graphcp import CPGroup, PrefillEngine, RuntimeConfig
from graphcp.dist import launch
from graphcp.kv.handle import KVHandleError
from graphcp.kv.spans import owned_layers
from graphcp.model.dsa.export import (
    MLA_FORMAT,
    MlaExport,
    MlaMeta,
    half_split_to_interleaved,
    interleaved_to_half_split,
)
from graphcp.pd.export import KVFormatError
from graphcp.pd.files import read_kv, save_kv
from graphcp.pd.hf import cache_argument
from graphcp.pd.load import load_kv
from graphcp.pd.mooncake import mooncake_problem
from graphcp.runtime.engine import prefill_after_prefixes

#: 4 dense layers, index_topk 16; GLM with "shared" layers (no indexer keys there)
CASES = {
    "deepseek_v32": ("deepseek_v32", dict(num_hidden_layers=4, first_k_dense_replace=4)),
    "glm_moe_dsa-shared": ("glm_moe_dsa", dict(num_hidden_layers=4, first_k_dense_replace=4,
                                               indexer_types=["full", "shared", "full", "shared"])),
}
#: dtype -> (cached prefix, its extension); then MORE tokens continued by transformers
LENS = {"float32": (45, 70), "bfloat16": (6, 9)}
MORE = 4
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_cases(tmp_path_factory, CASES, seed=3)


def _tokens(dtype="float32"):
    rng = np.random.default_rng(11)
    prefix, new = LENS[dtype]
    return rng.integers(0, 512, prefix), rng.integers(0, 512, new), rng.integers(0, 512, MORE)


def _export(group, folder, dtype, mode, path=None):
    """A cached prefix, then its extension; the export to every rank and to rank 0 (which
    also writes it to ``path``); then the handle is released and exporting it refused."""
    pre, new, _ = _tokens(dtype)
    eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=1024, kv_cache=mode), group)
    o = prefill_after_prefixes(eng, [(pre, new)])
    h = o.handles[0]
    everyone, to_0 = eng.export_kv(h), eng.export_kv(h, dst=0)
    if to_0 is not None and path is not None:
        to_0.token_ids = torch.from_numpy(np.concatenate([pre, new]))
        to_0.last_logits = o.last_logits[0]
        save_kv(to_0, path)
    eng.release(h)
    try:
        eng.export_kv(h)
        refused = None
    except KVHandleError as e:
        refused = str(e)
    return everyone, to_0, refused, eng.stats()["kv_pool_bytes"]


def _names(e) -> list[tuple[int, str]]:
    return e.meta.tensors()


def _hf_cache(folder, dtype):
    from transformers import AutoModelForCausalLM

    pre, new, _ = _tokens(dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        return model(input_ids=torch.from_numpy(np.concatenate([pre, new]))[None], use_cache=True).past_key_values


def _check_against_transformers(e: MlaExport, cache, dtype, what):
    m = e.meta
    assert m.num_tokens == sum(LENS[dtype]) and m.format == MLA_FORMAT, what
    for i in range(m.num_layers):
        ref, got = cache.layers[i], e.layers[i]
        assert rel_err(got["latent"].float(), ref.keys[0, 0].float()) < TOL[dtype], (what, i)
        rope = interleaved_to_half_split(got["rope_key"])  # the documented permutation
        assert rel_err(rope.float(), ref.values[0, 0].float()) < TOL[dtype], (what, i)
        assert torch.equal(half_split_to_interleaved(rope), got["rope_key"])
        assert ("index_key" in got) == (i in m.index_layers), (what, i)
        if "index_key" in got:
            key = interleaved_to_half_split(got["index_key"], m.rope_dim) if m.index_rope_interleaved else got[
                "index_key"]
            assert rel_err(key.float(), ref.indexer_keys[0].float()) < TOL[dtype], (what, i)


@pytest.mark.parametrize("case", list(CASES))
def test_export_equals_transformers_cache_replicated_and_layer_split(folders, case, tmp_path):
    folder = folders[case]
    for dtype in ("float32", "bfloat16"):
        cache = _hf_cache(folder, dtype)
        one, _, refused, _ = _export(CPGroup(), folder, dtype, "replicated")
        _check_against_transformers(one, cache, dtype, (case, dtype, 1))
        assert "not live" in refused
        runs = {mode: launch(_export, 2, folder, dtype, mode, str(tmp_path / f"{mode}-{dtype}.safetensors"))
                for mode in ("replicated", "layer-split")}
        ref = runs["replicated"][0][0]
        _check_against_transformers(ref, cache, dtype, (case, dtype, 2))
        for mode, ranks in runs.items():
            for rank, (everyone, to_0, refused, pool) in enumerate(ranks):
                what = (case, dtype, mode, rank)
                # the layer split sends each layer from its owner: the same bits as the replicated cache
                assert everyone.meta == ref.meta, what
                assert all(torch.equal(everyone.tensor(i, n), ref.tensor(i, n)) for i, n in _names(ref)), what
                assert (to_0 is None) == (rank == 1), what
                assert "not live" in refused, what
            back = read_kv(tmp_path / f"{mode}-{dtype}.safetensors")  # the file round trip
            assert isinstance(back, MlaExport) and back.meta == ref.meta and back.token_ids.shape == (sum(LENS[dtype]),)
            assert all(torch.equal(back.tensor(i, n), ref.tensor(i, n)) for i, n in _names(ref)), (case, mode)
        assert runs["layer-split"][0][3] < runs["replicated"][0][3]  # and it held less


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_continues_from_the_exported_cache(folders, case, tmp_path):
    """load_kv builds transformers' DSA cache (DynamicIndexedLayer per layer): its
    next-token logits for MORE tokens equal transformers' on the whole sequence."""
    from transformers import AutoModelForCausalLM

    folder = folders[case]
    launch(_export, 2, folder, "float32", "layer-split", str(tmp_path / "kv.safetensors"))
    loaded = load_kv(tmp_path / "kv.safetensors")
    assert loaded.num_tokens == sum(LENS["float32"])
    assert type(loaded.cache.layers[0]).__name__ == "DynamicIndexedLayer"
    pre, new, more = _tokens()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        full = model(input_ids=torch.from_numpy(np.concatenate([pre, new, more]))[None]).logits[0, -MORE:]
        cont = model(input_ids=torch.from_numpy(more)[None], use_cache=True,
                     **{cache_argument(model): loaded.cache}).logits[0]
    assert rel_err(cont, full) < 1e-4, case
    assert loaded.cache.get_seq_length() == sum(LENS["float32"]) + MORE


@pytest.mark.skipif(mooncake_problem() is not None, reason=f"Mooncake transport unavailable: {mooncake_problem()}")
def test_mooncake_carries_the_mla_format_from_a_layer_split_cache(folders, tmp_path):
    from test_pd_mooncake import Receiver

    rx = Receiver("good", tmp_path, ["dsa"], timeout_s=120)
    pre, new, _ = _tokens()
    rt = RuntimeConfig(kv_tokens=1024, kv_cache="layer-split")
    sent = launch(send_export, 2, folders["glm_moe_dsa-shared"], rx.address, rt, pre, new, "dsa")[0]
    got = rx.results()
    assert got["dsa"] == ("ok", ""), got
    recv = read_kv(tmp_path / "dsa.safetensors")
    assert recv.meta == sent.meta
    assert all(torch.equal(recv.tensor(i, n), sent.tensor(i, n)) for i, n in _names(sent))


def test_malformed_mla_files_are_refused_naming_what_is_wrong(folders, tmp_path):
    e, _, _, _ = _export(CPGroup(), folders["glm_moe_dsa-shared"], "float32", "replicated")
    good = e.meta.to_dict()
    assert good["index_layers"] == "0,2" and MlaMeta.from_dict(good) == e.meta
    tensors = {f"{n}.{i}": e.tensor(i, n).contiguous() for i, n in _names(e)}
    for name, meta, ts, says in (
        ("bad-index", {**good, "index_layers": "0,9"}, tensors, r"index_layers must be increasing layers of 0..3, "
                                                               r"got \[0, 9\]"),
        ("no-rank", {k: v for k, v in good.items() if k != "kv_lora_rank"}, tensors,
         r"missing MLA KV metadata \['kv_lora_rank'\]"),
        ("bad-format", {**good, "format": "graphcp-mla/9"}, tensors, "format 'graphcp-mla/9' is none of"),
        ("no-index-key", good, {k: v for k, v in tensors.items() if k != "index_key.2"},
         r"missing tensors \['index_key.2'\]"),
        ("short", good, {**tensors, "latent.1": tensors["latent.1"][:-1]}, r"latent.1 is \(114, 32\)"),
    ):
        path = tmp_path / f"{name}.safetensors"
        save_file(ts, str(path), metadata=meta)
        with pytest.raises(KVFormatError, match=says):
            read_kv(path)
    with pytest.raises(KVFormatError, match="layer 1 has .*'index_key'.*, expected"):
        MlaExport(e.meta, [dict(t, index_key=e.layers[0]["index_key"]) if i == 1 else t
                           for i, t in enumerate(e.layers)]).check()
    with safe_open(str(save_kv(e, tmp_path / "ok.safetensors")), framework="pt") as f:
        assert json.loads(json.dumps(f.metadata()))["family"] == "glm_moe_dsa"


def mla_pool_layers(indexer_layers: tuple[bool, ...], rank: int, cp_size: int) -> tuple[int, int]:
    """Layers a rank's layer-split pools hold: (latent pool, indexer-key pool), each with its scratch layer."""
    owned = owned_layers(rank, len(indexer_layers), cp_size)
    return len(owned) + 1, sum(indexer_layers[i] for i in owned) + 1


def test_prefill_command_exports_dsa_files_at_cp2_layer_split(folders, tmp_path, capsys):
    """``graphcp prefill --export-kv DIR --kv-cache layer-split --cp 2`` on a DSA model: one
    graphcp-mla/1 file a request (with a cached prefix), loadable as transformers' cache;
    the --stats file's pool bytes count both pools as held."""
    from graphcp.cli.main import main
    folder = folders["glm_moe_dsa-shared"]
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps({"tokens": list(range(5, 60))}) + "\n"
                    + json.dumps({"tokens": list(range(100, 140)), "prefix": 21}) + "\n")
    code = main([str(a) for a in ("prefill", "--model", folder, "--input", reqs, "--output", tmp_path / "o.pt",
                                  "--cp", 2, "--graph", "off", "--kv-cache", "layer-split", "--kv-tokens", 512,
                                  "--export-kv", tmp_path / "kv", "--stats", tmp_path / "stats.json")])
    assert code == 0, capsys.readouterr().err[-2000:]
    cfg = json.loads((folder / "config.json").read_text())
    indexer = tuple(t == "full" for t in cfg["indexer_types"])
    per_token = {"latent": cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], "index": cfg["index_head_dim"]}
    ranks = json.loads((tmp_path / "stats.json").read_text())["ranks"]
    ps = RuntimeConfig().page_size  # the command's default
    for r in ranks:
        latent_layers, index_layers = mla_pool_layers(indexer, r["rank"], 2)
        pages = r["kv_pool_tokens"] // ps + 1  # + the scratch page
        want = pages * ps * (latent_layers * per_token["latent"] + index_layers * per_token["index"]) * 4
        assert (r["kv_cache"], r["kv_pool_bytes"]) == ("layer-split", want), r
    logits = torch.load(tmp_path / "o.pt")["last_logits"]
    for i, n in enumerate((55, 40)):
        kv = load_kv(tmp_path / "kv" / f"{i}.safetensors")
        assert isinstance(kv.export, MlaExport) and kv.num_tokens == n and kv.export.meta.index_layers == (0, 2)
        assert kv.cache.get_seq_length() == n and torch.equal(kv.export.last_logits, logits[i])


def test_a_program_that_only_reads_kv_finds_the_family_formats(tmp_path):
    """graphcp.pd sits below the model, so it reads the formats registered so far: in a
    fresh interpreter that imported only graphcp.pd that is graphcp-kv/1 alone, and
    ``from graphcp import load_kv`` (or read_kv, KVReceiver) registers every built-in
    family's first (docs/pd.md)."""
    meta = MlaMeta(3, 2, 4, 2, 4, (0,), False, "deepseek_v32", "float32", 16, "fp")
    layers = [{n: torch.randn(meta.tensor_shape(i, n)) for n in meta.layer_tensors(i)} for i in range(2)]
    path = save_kv(MlaExport(meta, layers), tmp_path / "mla.safetensors")
    script = (
        "import sys\n"
        "from graphcp.pd import KVFormatError, load_kv as pd_load_kv\n"
        "from graphcp.pd.formats import registered\n"
        "assert 'graphcp.model' not in sys.modules and registered() == ['graphcp-kv/1'], registered()\n"
        "try:\n"
        "    pd_load_kv(sys.argv[1])\n"
        "    raise SystemExit('read a format nothing registered')\n"
        "except KVFormatError as e:\n"
        "    assert 'graphcp-mla/1' in str(e), e\n"
        "from graphcp import load_kv, read_kv\n"
        "assert registered() == ['graphcp-kv/1', 'graphcp-mla/1', 'graphcp-dsv4/1', 'graphcp-kda/1', "
            "'graphcp-glm5next/1', 'graphcp-hybrid/1'], registered()\n"
        "assert read_kv(sys.argv[1]).meta.format == 'graphcp-mla/1'\n"
        "assert load_kv(sys.argv[1]).export.meta.format == 'graphcp-mla/1'\n"
    )
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300,
                       cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
