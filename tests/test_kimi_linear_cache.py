"""Kimi Linear's cache, export, checkpoints and bad input (docs/kimi_linear.md), on
tests/conftest.py's KIMI_TINY:

- the states: the pool estimate is what the cache allocates and what ``engine.stats()``
  counts (the MLA layers' latent rows, the KDA layers' two slots a live request); a batch
  needing more live requests than ``state_slots`` is refused and changes nothing; a
  forward that fails after its KDA layers wrote leaves the prefix's states as they were;
- the export (``graphcp-kda/1``) of a request prefilled in two pieces (the second starts
  inside the first's convolution halo), in the replicated and layer-split caches at CP
  1, 2 and 4, under pipeline stages and with ``--moe tp``: through a file, ``load_kv``
  gives transformers' cache and transformers continues the request step by step within
  1e-4 (float32; bfloat16 2e-2 on the all-experts twin) of its own one-shot run; imported
  at CP 2 (replicated, layer-split), the request's rest equals transformers' one shot;
- a checkpoint in transformers' in-memory spelling (a state dict saved as it is: the
  stacked conv, ``forget_gate.``, merged experts) gives the logits of the
  ``save_pretrained`` one, at ``--moe ep`` and ``tp``;
- the token-sharded cache is refused in one line (the other pairs, and attention DP and
  auxiliary hidden states against one rank: tests/test_combinations.py);
- bad input: a missing KDA tensor, a ``linear_attn_config`` naming a layer twice or past
  the last, a conv kernel the kernels do not take, KV heads other than the query heads,
  a mesh that cannot split the heads or the experts: one line, exit 2, nothing written;
  the preset from the command line.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from helpers import rel_err
from safetensors.torch import load_file, save_file
from test_error_contract import one_line_error

from graphcp import ConfigError, KVCacheFull, ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch
from graphcp.kv import factory
from graphcp.model.kimi_linear.mla import LatentAttention
from graphcp.pd.files import read_kv, save_kv
from graphcp.pd.hf import cache_argument
from graphcp.pd.load import load_kv

TOL = {"float32": 1e-4, "bfloat16": 2e-2}
LENS = [1, 7, 45, 130]
SPLIT = 50
ALL_EXPERTS = dict(num_experts_per_tok=8, n_group=1)


def _tokens():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 512, n) for n in LENS]


@pytest.fixture(scope="module")
def folders(hf_model_dir):
    return {"float32": hf_model_dir("kimi_linear"), "bfloat16": hf_model_dir("kimi_linear", **ALL_EXPERTS)}


def test_the_states_the_estimate_and_stats(folders):
    eng = PrefillEngine(folders["float32"], RuntimeConfig(kv_tokens=512, state_slots=3))
    kv, cfg = eng.parts.kv, eng.cfg
    k, m = cfg.hybrid.kda, cfg.hybrid.latent
    linear = len(k.linear_layers)
    recurrent = linear * 2 * 3 * k.num_heads * k.head_dim * k.head_dim * 4
    conv = linear * 2 * 3 * k.conv_kernel * k.conv_dim * 4
    st = eng.stats()
    assert st["kv_state_pools"] == {"linear_recurrent": recurrent, "linear_conv": conv}
    latent = len(k.full_layers) * kv.num_pages * kv.page_size * m.latent_dim * 4
    assert st["kv_pool_bytes"] == kv.pool_bytes == latent + recurrent + conv
    geometry = eng.parts.family.cache_geometry(cfg, eng.runtime)
    pool = factory.PoolSpec(range(cfg.num_layers), kv.num_pages, kv.page_size, torch.float32)
    assert factory.pool_bytes("replicated", geometry, pool) == kv.pool_bytes
    toks = _tokens()
    handles = eng.prefill([Request(t) for t in toks[:3]]).handles
    before = kv.snapshot()
    with pytest.raises(KVCacheFull, match="the cache keeps 3; raise RuntimeConfig.state_slots"):
        eng.prefill([Request(toks[3])])
    assert kv.snapshot() == before
    eng.release(handles[0])
    handles = [*handles[1:], eng.prefill([Request(toks[3])]).handles[0]]
    for h in handles:
        eng.release(h)
    assert kv.stored_tokens() == 0


def test_a_failed_forward_leaves_the_prefix_states(folders, hf_model, monkeypatch):
    long = _tokens()[3]
    with torch.no_grad():
        want = hf_model(folders["float32"])(torch.tensor(long)[None]).logits[0].float()
    eng = PrefillEngine(folders["float32"], RuntimeConfig(kv_tokens=512))
    head = eng.prefill([Request(long[:SPLIT])], all_logits=True)
    before = eng.parts.kv.snapshot()

    def fail(*args):
        raise RuntimeError("injected")

    with monkeypatch.context() as m:
        m.setattr(LatentAttention, "project", fail)  # layer 2 (MLA), after layers 0-1 (KDA) wrote their states
        with pytest.raises(RuntimeError, match="injected"):
            eng.prefill([Request(long[SPLIT:], head.handles[0])])
    assert eng.parts.kv.snapshot() == before
    tail = eng.prefill([Request(long[SPLIT:], head.handles[0])], all_logits=True)
    assert rel_err(torch.cat([head.logits[0], tail.logits[0]]), want) <= TOL["float32"]


def _export_chunked(group, folder, dtype, runs):
    """The long request prefilled in two pieces and exported to rank 0, per (cache mode,
    parallel, moe) run; rank 0's exports."""
    toks = _tokens()[3]
    out, first = [], False
    for mode, par, moe in runs:
        eng = PrefillEngine(folder, RuntimeConfig(kv_cache=mode, kv_tokens=1024, dtype=dtype, moe=moe), group, None,
                            ParallelConfig(**par))
        head = eng.prefill([Request(toks[:SPLIT])])
        tail = eng.prefill([Request(toks[SPLIT:], head.handles[0])])
        out.append(eng.export_kv(tail.handles[0], dst=0))
        first = eng.parts.world.rank == 0
    return out if first else None


#: world -> (cache mode, parallel, moe) runs of the export
EXPORTS = {
    1: [("replicated", dict(), "ep")],
    2: [("replicated", dict(cp_size=2), "tp"), ("layer-split", dict(cp_size=2), "ep")],
    4: [("layer-split", dict(cp_size=4), "tp"), ("replicated", dict(cp_size=2, pp_size=2, tp_size=2), "ep")],
}


@pytest.mark.parametrize("world,dtype", [(1, "float32"), (2, "float32"), (4, "float32"), (2, "bfloat16")])
def test_the_export_continues_in_transformers(folders, hf_model, tmp_path, world, dtype):
    folder = folders[dtype]
    model = hf_model(folder, dtype)
    prompt = [int(t) for t in _tokens()[3]]
    fed = prompt + [5, 9, 200, 31]  # the continuation's tokens, fed one a step
    with torch.no_grad():
        want = model(torch.tensor([fed])).logits[0, len(prompt):].float()
    exports = [e for e in launch(_export_chunked, world, folder, dtype, EXPORTS[world]) if e is not None][0]
    for run, exported in zip(EXPORTS[world], exports, strict=True):
        loaded = load_kv(save_kv(exported.check(), tmp_path / f"{run[0]}.safetensors"))
        assert loaded.export.meta.format == "graphcp-kda/1" and loaded.num_tokens == len(prompt)
        cache = loaded.cache
        assert int(cache.get_seq_length()) == len(prompt), run
        with torch.no_grad():
            steps = torch.stack([model(input_ids=torch.tensor([[t]]), use_cache=True,
                                       **{cache_argument(model): cache}).logits[0, -1].float()
                                 for t in fed[len(prompt):]])
        assert rel_err(steps, want) <= TOL[dtype], (world, run, dtype)


def _import_job(group, folder, mode, exported):
    """The exported prefix placed in this engine's cache, then the request's rest prefilled."""
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, kv_cache=mode), group)
    handle = eng.import_kv(exported)
    out = eng.prefill([Request(_tokens()[3][SPLIT:], handle)], all_logits=True)
    return out.logits[0].clone()


@pytest.mark.parametrize("mode", ["replicated", "layer-split"])
def test_an_import_continues_as_one_shot(folders, hf_model, mode):
    """A prefix exported at CP 1 and imported at CP 2 (its KDA states and MLA rows placed as
    the cache mode assigns them): the continuation equals transformers' one shot."""
    folder, long = folders["float32"], _tokens()[3]
    src = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024))
    exported = src.export_kv(src.prefill([Request(long[:SPLIT])]).handles[0])
    with torch.no_grad():
        want = hf_model(folder)(torch.tensor(long)[None]).logits[0, SPLIT:].float()
    for got in launch(_import_job, 2, folder, mode, exported):
        assert rel_err(got, want) <= TOL["float32"], mode


def test_the_in_memory_spelling_loads_as_the_saved_one(folders, hf_model, tmp_path):
    """transformers' in-memory names (its state dict, saved as it is) read to the same model."""
    folder = folders["float32"]
    mem = tmp_path / "in-memory"
    mem.mkdir()
    shutil.copy(folder / "config.json", mem / "config.json")
    state = {k: v.contiguous() for k, v in hf_model(folder).state_dict().items()}
    assert any(".forget_gate." in k for k in state) and any(".experts.gate_up_proj" in k for k in state)
    save_file(state, mem / "model.safetensors", metadata={"format": "pt"})
    toks = _tokens()
    for moe in ("ep", "tp"):
        got = [PrefillEngine(f, RuntimeConfig(kv_tokens=512, moe=moe)).prefill([Request(t) for t in toks]).last_logits
               for f in (folder, mem)]
        assert torch.equal(got[0], got[1]), moe


def test_the_sharded_cache_is_refused_in_one_line(folders):
    with pytest.raises(ConfigError) as e:
        PrefillEngine(folders["float32"], RuntimeConfig(kv_cache="sharded"))
    msg = str(e.value)
    assert "\n" not in msg and "kv_cache='sharded'" in msg and "layer-split" in msg, msg


def _edit(src, dst, config=None, drop=None):
    shutil.copytree(src, dst)
    if config is not None:
        d = json.loads((dst / "config.json").read_text())
        d.update(config)
        (dst / "config.json").write_text(json.dumps(d))
    if drop is not None:
        tensors = load_file(dst / "model.safetensors")
        del tensors[drop]
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _linear_attn(kda, full):
    return {"layer_types": None, "linear_attn_config": {"kda_layers": kda, "full_attn_layers": full}}


@pytest.mark.parametrize("edit,match", [
    (dict(drop="model.layers.1.self_attn.A_log"), r"missing tensor 'model\.layers\.1\.self_attn\.A_log'"),
    (dict(drop="model.layers.3.self_attn.k_conv1d.weight"), r"missing tensor 'model\.layers\.3\.self_attn\.k_conv1d"),
    (dict(config=_linear_attn([1, 2, 3, 4], [3])), r"linear_attn_config names layer 3 twice"),
    (dict(config=_linear_attn([1, 2, 4], [5])), r"linear_attn_config\.full_attn_layers entry .*5"),
    (dict(config=_linear_attn([1, 2], [3])), r"names neither kind for layer 4"),
    (dict(config={"linear_conv_kernel_dim": 5}), r"short_conv_kernel_size=5 is not supported; .* widths 2, 3, 4"),
    (dict(config={"num_key_value_heads": 2}), r"num_key_value_heads=2 must equal num_attention_heads=4"),
    # a mesh that cannot split the model: the MLA heads under attention TP (one latent head a
    # token), the 8 experts over 3 ranks (ep), the experts' intermediate size 32 over 3 (tp)
    (dict(args=("--tp", "2", "--cp", "1")), r"attention TP > 1 .*one latent head"),
    (dict(args=("--cp", "3")), r"num_experts=8 does not divide by --cp 3"),
    (dict(args=("--cp", "3", "--moe", "tp")), r"intermediate size 32 does not divide by --cp 3"),
])
def test_bad_input_is_one_line(folders, tmp_path, capsys, edit, match):
    edit = dict(edit)
    args = edit.pop("args", ())
    bad = _edit(folders["float32"], tmp_path / "bad", **edit)
    req = tmp_path / "req.jsonl"
    req.write_text(json.dumps({"tokens": [1, 2, 3]}) + "\n")
    out = tmp_path / "o.pt"
    one_line_error(capsys, ["prefill", "--model", bad, "--input", req, "--output", out, *args], match=match)
    assert not out.exists()  # nothing written


def test_the_preset_prefills_from_the_command_line(tmp_path, monkeypatch):
    from graphcp.cli.main import main

    monkeypatch.setenv("GRAPHCP_CACHE", str(tmp_path / "cache"))
    req = tmp_path / "req.jsonl"
    req.write_text("".join(json.dumps({"tokens": t}) + "\n" for t in ([1, 2, 3, 4, 5], [9, 8, 7])))
    out = tmp_path / "out.pt"
    argv = ["prefill", "--model", "default-kimi", "--input", req, "--output", out, "--cp", "2",
            "--export-kv", tmp_path / "kv"]
    assert main([str(a) for a in argv]) == 0
    logits = torch.load(out)["last_logits"]
    assert logits.shape == (2, 8192) and torch.isfinite(logits).all()
    meta = read_kv(tmp_path / "kv" / "0.safetensors").meta
    assert meta.format == "graphcp-kda/1" and meta.num_tokens == 5
