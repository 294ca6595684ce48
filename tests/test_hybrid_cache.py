"""A hybrid's cache and export (docs/hybrid.md), on tests/conftest.py's tiny Qwen3.5:

- the states: the pool estimate is what the cache allocates and what ``engine.stats()``
  counts; a batch needing more live requests than ``state_slots`` is refused and changes
  nothing, a released handle frees its slots; a forward that fails after its linear layers
  wrote leaves the prefix's state as it was (the continuation is exact afterwards);
- the compositions against transformers (float32, 1e-4, the batch and a chunked
  continuation): the sharded and layer-split caches at CP 2, attention TP 2 at CP 2,
  pipeline stages and attention DP;
- the export (graphcp-hybrid/1) of a chunked request in every cache mode, under attention
  TP and pipeline stages: through a file, ``load_kv`` gives transformers' cache and
  transformers continues within 1e-4 of its one shot; sent over Mooncake, it arrives
  bitwise equal to ``export_kv``;
- bad input: a missing linear-layer tensor, an unsupported conv kernel or head count, a
  layer-type list that disagrees with the layer count: one line, exit 2.
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

from graphcp import KVCacheFull, ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch
from graphcp.kv import factory
from graphcp.model.hybrid.layers import GatedAttention
from graphcp.pd.files import read_kv, save_kv
from graphcp.pd.hf import cache_argument, greedy_continue
from graphcp.pd.load import load_kv
from graphcp.pd.mooncake import mooncake_problem

TOL = 1e-4
LENS = [1, 7, 45, 130]
SPLIT = 50


def _tokens():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 512, n) for n in LENS]


@pytest.fixture(scope="module")
def folder(hf_model_dir):
    return hf_model_dir("qwen3_5_text")


@pytest.fixture(scope="module")
def reference(folder, hf_model):
    """transformers' float32 logits of every request, and of the long one and its next token."""
    model = hf_model(folder)
    toks = _tokens()
    nxt = np.concatenate([toks[3], [5]])
    with torch.no_grad():
        return ([model(torch.tensor(t)[None]).logits[0].float() for t in toks],
                model(torch.tensor(nxt)[None]).logits[0, -1].float())


def test_state_slots_the_estimate_stats_and_release(folder):
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=512, state_slots=2))
    kv, cfg = eng.parts.kv, eng.cfg
    h = cfg.hybrid
    linear = len(h.linear_layers)
    recurrent = linear * 2 * 2 * h.num_v_heads * h.k_head_dim * h.v_head_dim * 4
    conv = linear * 2 * 2 * h.conv_kernel * h.conv_dim * 4
    st = eng.stats()
    assert st["kv_state_pools"] == {"linear_recurrent": recurrent, "linear_conv": conv}
    assert st["kv_pool_bytes"] == kv.pool_bytes == sum(st["kv_pools"].values()) + recurrent + conv
    geometry = eng.parts.family.cache_geometry(cfg, eng.runtime)
    pool = factory.PoolSpec(range(cfg.num_layers), kv.num_pages, kv.page_size, torch.float32)
    assert factory.pool_bytes("replicated", geometry, pool) == kv.pool_bytes
    toks = _tokens()
    a, b = eng.prefill([Request(toks[1]), Request(toks[2])]).handles
    before = kv.snapshot()
    with pytest.raises(KVCacheFull, match="the cache keeps 2; raise RuntimeConfig.state_slots"):
        eng.prefill([Request(toks[0])])
    assert kv.snapshot() == before
    eng.release(a)
    c = eng.prefill([Request(toks[0])]).handles[0]
    for x in (b, c):
        eng.release(x)
    assert kv.stored_tokens() == 0


def test_a_failed_forward_leaves_the_prefix_state(folder, reference, monkeypatch):
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=512))
    long = _tokens()[3]
    head = eng.prefill([Request(long[:SPLIT])], all_logits=True)
    before = eng.parts.kv.snapshot()

    def fail(*args):
        raise RuntimeError("injected")

    with monkeypatch.context() as m:
        m.setattr(GatedAttention, "project", fail)  # after layers 0-2 (linear) wrote their states
        with pytest.raises(RuntimeError, match="injected"):
            eng.prefill([Request(long[SPLIT:], head.handles[0])])
    assert eng.parts.kv.snapshot() == before
    tail = eng.prefill([Request(long[SPLIT:], head.handles[0])], all_logits=True)
    assert rel_err(torch.cat([head.logits[0], tail.logits[0]]), reference[0][3]) <= TOL


#: (world, cache mode, parallel) runs: each prefills the batch, then the long request in two
#: chunks, and exports it (every rank receiving) when the run exports
RUNS = {
    2: [("sharded", dict(cp_size=2), True), ("layer-split", dict(cp_size=2), True),
        ("replicated", dict(cp_size=2), True)],
    4: [("sharded", dict(cp_size=2, tp_size=4), True), ("layer-split", dict(cp_size=2, pp_size=2), True),
        ("replicated", dict(cp_size=2, dp_size=2, tp_size=4), False)],
}


def _job(group, folder, runs):
    out = []
    toks = _tokens()
    for mode, par, export in runs:
        eng = PrefillEngine(folder, RuntimeConfig(kv_cache=mode, kv_tokens=1024), group, None, ParallelConfig(**par))
        one = eng.prefill([Request(t) for t in toks], all_logits=True)
        head = eng.prefill([Request(toks[3][:SPLIT])], all_logits=True)
        tail = eng.prefill([Request(toks[3][SPLIT:], head.handles[0])], all_logits=True)
        exported = eng.export_kv(tail.handles[0]) if export else None
        out.append(([x.clone() for x in one.logits], torch.cat([head.logits[0], tail.logits[0]]), exported))
    return out


@pytest.mark.parametrize("world", sorted(RUNS))
def test_compositions_and_the_export_continue_in_transformers(folder, reference, hf_model, tmp_path, world):
    model = hf_model(folder)
    results = launch(_job, world, folder, RUNS[world])
    for rank, per_run in enumerate(results):
        for (mode, par, export), (one, chunked, exported) in zip(RUNS[world], per_run):
            where = (rank, mode, par)
            for got, want in zip(one, reference[0], strict=True):
                assert rel_err(got, want) <= TOL, where
            assert rel_err(chunked, reference[0][3]) <= TOL, where
            if not export or rank:
                continue
            path = save_kv(exported.check(), tmp_path / f"{mode}-{world}.safetensors")
            loaded = load_kv(path)
            assert loaded.export.meta.format == "graphcp-hybrid/1" and loaded.num_tokens == LENS[3]
            _, first = greedy_continue(model, loaded.cache, 5, 1)
            assert rel_err(first, reference[1]) <= TOL, where


EXPORT_TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def _export_chunked(group, folder, dtype):
    """The long request prefilled in two chunks (the second starts inside the first's conv
    halo) and exported to rank 0, in every cache mode at CP = the world."""
    toks = _tokens()[3]
    out = {}
    for mode in ("replicated", "sharded", "layer-split"):
        eng = PrefillEngine(folder, RuntimeConfig(kv_cache=mode, kv_tokens=1024, dtype=dtype), group, None,
                            ParallelConfig(cp_size=group.size))
        head = eng.prefill([Request(toks[:SPLIT])])
        tail = eng.prefill([Request(toks[SPLIT:], head.handles[0])])
        out[mode] = eng.export_kv(tail.handles[0], dst=0)
    return out if group.rank == 0 else None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_export_continues_in_transformers_at_every_cp_and_mode(folder, hf_model, tmp_path, world, dtype):
    """load_kv's cache continues in the installed transformers as its own one-shot run of the
    whole sequence does, step after step (the positions included), within 1e-4 in float32."""
    model = hf_model(folder, dtype)
    prompt = [int(t) for t in _tokens()[3]]
    fed = prompt + [5, 9, 200, 31]  # the continuation's tokens, fed one a step
    with torch.no_grad():
        want = model(torch.tensor([fed])).logits[0, len(prompt):].float()
    exports = launch(_export_chunked, world, folder, dtype)[0]
    for mode, exported in exports.items():
        cache = load_kv(save_kv(exported.check(), tmp_path / f"{mode}.safetensors")).cache
        assert int(cache.get_seq_length()) == len(prompt), mode
        with torch.no_grad():
            steps = torch.stack([model(input_ids=torch.tensor([[t]]), use_cache=True,
                                       **{cache_argument(model): cache}).logits[0, -1].float()
                                 for t in fed[len(prompt):]])
        assert rel_err(steps, want) <= EXPORT_TOL[dtype], (world, mode, dtype)


def _send(group, folder, address):
    from graphcp.pd.sender import KVSender

    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=1024, kv_cache="sharded"), group)
    handles = eng.prefill([Request(t) for t in _tokens()]).handles
    handles = eng.prefill([Request([7, 8, 9, 10, 11], h) for h in handles]).handles  # a rank's runs of positions
    sender = KVSender(address, group.rank, group.size, timeout_s=60)
    sender.send(eng, handles, [f"h-{i}" for i in range(len(handles))])
    sender.close()
    exports = eng.export_kv_batch(handles, dst=0)
    return exports if group.rank == 0 else None


@pytest.mark.skipif(mooncake_problem() is not None, reason=f"Mooncake unavailable: {mooncake_problem()}")
def test_mooncake_sends_the_export_bitwise(folder, tmp_path):
    from test_pd_mooncake import Receiver

    ids = [f"h-{i}" for i in range(len(LENS))]
    rx = Receiver("good", tmp_path, ids, timeout_s=120)
    sent = launch(_send, 2, folder, rx.address)[0]
    got = rx.results()
    assert got.pop("completed") == [] and all(v == ("ok", "") for v in got.values()), got
    for i, export in enumerate(sent):
        recv = read_kv(tmp_path / f"h-{i}.safetensors")
        assert recv.meta == export.meta
        for layer, tensors in enumerate(export.layers):
            assert all(torch.equal(recv.tensor(layer, n), t) for n, t in tensors.items()), (i, layer)


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


@pytest.mark.parametrize("edit,match", [
    (dict(drop="model.layers.1.linear_attn.A_log"), r"missing tensor 'model\.layers\.1\.linear_attn\.A_log'"),
    (dict(config={"linear_conv_kernel_dim": 5}), r"linear_conv_kernel_dim=5 is not supported; .* widths 2, 3, 4"),
    (dict(config={"linear_num_value_heads": 3}), r"linear_num_value_heads=3 is not a multiple of "
                                                 r"linear_num_key_heads=2"),
    (dict(config={"layer_types": ["linear_attention", "full_attention"]}),
     r"layer_types lists 2 entries, expected num_hidden_layers=4"),
])
def test_bad_input_is_one_line(folder, tmp_path, capsys, edit, match):
    bad = _edit(folder, tmp_path / "bad", **edit)
    req = tmp_path / "req.jsonl"
    req.write_text(json.dumps({"tokens": [1, 2, 3]}) + "\n")
    one_line_error(capsys, ["prefill", "--model", bad, "--input", req, "--output", tmp_path / "o.pt"], match=match)


def test_the_preset_prefills_from_the_command_line(tmp_path, monkeypatch):
    from graphcp.cli.main import main

    monkeypatch.setenv("GRAPHCP_CACHE", str(tmp_path / "cache"))
    req = tmp_path / "req.jsonl"
    req.write_text("".join(json.dumps({"tokens": t}) + "\n" for t in ([1, 2, 3, 4, 5], [9, 8, 7])))
    out = tmp_path / "out.pt"
    argv = ["prefill", "--model", "default-hybrid", "--input", req, "--output", out, "--graph", "off",
            "--export-kv", tmp_path / "kv"]
    assert main([str(a) for a in argv]) == 0
    logits = torch.load(out)["last_logits"]
    assert logits.shape == (2, 8192) and torch.isfinite(logits).all()
    assert read_kv(tmp_path / "kv" / "0.safetensors").meta.num_tokens == 5


def test_the_memory_check_counts_the_states(folder, monkeypatch):
    """A machine with room for the K/V pool but not for the states refuses the engine."""
    import os

    from graphcp import ConfigError
    from graphcp.model.config import ModelConfig
    from graphcp.model.family import family_of
    from graphcp.runtime.pool_size import pool_pages, pool_spec

    rt = RuntimeConfig(kv_tokens=512, state_slots=4096)
    cfg = ModelConfig.from_file(folder / "config.json")
    geometry = family_of(cfg).cache_geometry(cfg, rt)
    pool = pool_spec(rt, pool_pages(rt, cfg), range(cfg.num_layers), 0, 1)
    whole = factory.pool_bytes("replicated", geometry, pool)
    states = len(cfg.hybrid.linear_layers) * 2 * 4096 * geometry.linear.state_bytes(4)
    assert states < whole
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 1 if name == "SC_PAGE_SIZE" else
                        (whole - states // 2 if name == "SC_PHYS_PAGES" else real(name)))
    with pytest.raises(ConfigError, match=r"kv_tokens=512: a KV pool of 512 tokens needs .* GiB, more than"):
        PrefillEngine(folder, rt)
