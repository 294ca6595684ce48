"""PD export of a DeepSeek V4 cache (format graphcp-dsv4/1): per layer transformers' V4
cache state, the window keys, and per compressor (CSA: also the indexer) the compressed
entries, the not-yet-pooled remainder (raw kv and gate) and CSA's overlap state (float32
gates), with the entry counts transformers keeps.

References: transformers' own cache after prefilling the same tokens in the same chunks
(a cached prefix of 21 tokens that splits a CSA (m = 4) and an HCA (m' = 8) block, then
30 more), beside a request below m (no entries, no overlap) and one a multiple of both
rates (empty remainders); and transformers continuing from ``load_kv`` of a written file
(next-token logits for 10 more tokens equal to transformers on the whole sequence,
float32 1e-4). CP 1 and 2 (zigzag, interleave), every rank and one receiving rank; files
and the flat transport layout round trip (bfloat16 with float32 gates); the Mooncake
transport carries it; ``graphcp prefill --export-kv`` writes it; malformed metadata is
refused naming what is wrong.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import rel_err, send_export
from safetensors.torch import save_file

from graphcp import CPGroup, PrefillEngine, RuntimeConfig
from graphcp.dist import launch
from graphcp.model.dsv4.cache import CSA, HCA
from graphcp.model.dsv4.export import DSV4_FORMAT, DsV4Export, DsV4Meta
from graphcp.pd.export import KVFormatError
from graphcp.pd.files import read_kv, save_kv
from graphcp.pd.load import load_kv
from graphcp.pd.mooncake import mooncake_problem
from graphcp.runtime.engine import prefill_after_prefixes

PRE, NEW, SHORT, ALIGNED, MORE = 21, 30, 3, 24, 10
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def folder(hf_model_dir):
    return hf_model_dir("deepseek_v4", False, "float32")


def _tokens():
    rng = np.random.default_rng(11)
    return [rng.integers(0, 512, n) for n in (PRE, NEW, SHORT, ALIGNED, MORE)]


def _export(group, folder, dtype, layouts, path=None):
    """Per layout: the three requests exported to every rank, and the first one to the
    last rank only (written to ``path`` there, with its token ids and logits)."""
    pre, new, short, aligned, _ = _tokens()
    out = []
    for layout in layouts:
        eng = PrefillEngine(folder, RuntimeConfig(dtype=dtype, layout=layout, kv_tokens=1024, graph="off"), group)
        o = prefill_after_prefixes(eng, [(pre, new), (None, short), (None, aligned)])
        everyone = eng.export_kv_batch(o.handles)
        to_last = eng.export_kv(o.handles[0], dst=group.size - 1)
        if to_last is not None and path is not None:
            to_last.token_ids = torch.from_numpy(np.concatenate([pre, new]))
            to_last.last_logits = o.last_logits[0]
            save_kv(to_last, path)
        out.append((everyone, to_last))
    return out


def _model(folder, dtype="float32"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()


@torch.inference_mode()
def _hf_caches(model):
    """transformers' caches of the three requests, prefilled in the same chunks."""
    pre, new, short, aligned, _ = _tokens()
    out = []
    for chunks in ((pre, new), (short,), (aligned,)):
        cache = None
        for c in chunks:
            cache = model(input_ids=torch.from_numpy(c)[None], use_cache=True, cache=cache).past_key_values
        out.append(cache)
    return out


def _check(e: DsV4Export, cache, T: int, tol: float, what) -> None:
    """Every tensor of the export equals transformers' state, and nothing of that state is missing."""
    m = e.meta
    assert (m.num_tokens, m.format, m.num_layers) == (T, DSV4_FORMAT, len(cache.layers)), what
    e.check()

    def same(got, ref, name):
        assert got.dtype == ref.dtype and got.shape == ref.shape, (what, name, got.shape, ref.shape, got.dtype)
        if got.numel():
            assert rel_err(got.float(), ref.float()) < tol, (what, name, rel_err(got.float(), ref.float()))

    for i, layer in enumerate(cache.layers):
        t = e.layers[i]
        same(t["window"], layer.keys[0, 0], (i, "window"))
        assert layer.get_seq_length() == T
        if m.layer_kinds[i] not in (CSA, HCA):
            assert set(t) == {"window"}, (what, i)
            continue
        names = ("compressor", "indexer") if m.layer_kinds[i] == CSA else ("compressor",)
        want = {"window"}
        for name in names:
            p = "index_" if name == "indexer" else ""
            assert layer.entry_count[name] == m.entries(i) == T // m.rate(i), (what, i, name)
            states = ["compressed_kv", "buffer_kv", "buffer_gate"]
            if m.layer_kinds[i] == CSA:
                assert (layer.overlap_kv[name] is None) == (T < m.rate(i)), (what, i, name)
                if layer.overlap_kv[name] is not None:
                    states += ["overlap_kv", "overlap_gate"]
            for s in states:
                same(t[p + s], getattr(layer, s)[name][0], (i, p + s))
                want.add(p + s)
        assert set(t) == want, (what, i, sorted(t), sorted(want))


def test_export_equals_transformers_cache_at_cp1_and_cp2(folder, tmp_path):
    caches = _hf_caches(_model(folder))
    lens = (PRE + NEW, SHORT, ALIGNED)
    (everyone, only), = _export(CPGroup(), folder, "float32", ("zigzag",))
    for e, cache, T in zip(everyone, caches, lens):
        _check(e, cache, T, TOL["float32"], ("cp1", T))
    assert only is not None
    ranks = launch(_export, 2, folder, "float32", ("zigzag", "interleave"), str(tmp_path / "kv.safetensors"))
    for rank, runs in enumerate(ranks):
        for layout, (exports, to_last) in zip(("zigzag", "interleave"), runs):
            what = ("cp2", layout, rank)
            for e, cache, T in zip(exports, caches, lens):
                _check(e, cache, T, TOL["float32"], what + (T,))
            assert (to_last is None) == (rank == 0), what
    ref = ranks[1][1][1]  # the export written last (rank 1's, interleave)
    back = read_kv(tmp_path / "kv.safetensors")  # the file round trip
    assert isinstance(back, DsV4Export) and back.meta == ref.meta and back.token_ids.shape == (PRE + NEW,)
    assert all(torch.equal(back.tensor(i, n), ref.tensor(i, n)) for i, n in ref.meta.tensors())


@pytest.mark.parametrize("topk", [3, 64])
def test_transformers_continues_from_the_loaded_file(hf_model_dir, folder, tmp_path, topk):
    """load_kv builds transformers' V4 cache (a window / CSA / HCA layer each): its logits
    for MORE tokens equal transformers' on the whole sequence, and it keeps counting.
    index_topk 3: the indexer's selection counts; 64: every entry is attended, so the
    entries the continuation pools from the overlap state and remainder count too (with
    3 the new entries may go unselected)."""
    if topk != 3:
        folder = hf_model_dir("deepseek_v4", False, "float32", index_topk=topk)
    path = tmp_path / "kv.safetensors"
    launch(_export, 2, folder, "float32", ("zigzag",), str(path))
    loaded = load_kv(path)
    assert loaded.num_tokens == PRE + NEW
    assert [type(c).__name__ for c in loaded.cache.layers] == ["DynamicSlidingWindowLayer", "DeepseekV4CSACache",
                                                                "DeepseekV4HCACache"]
    pre, new, _, _, more = _tokens()
    model = _model(folder)
    with torch.inference_mode():
        full = model(input_ids=torch.from_numpy(np.concatenate([pre, new, more]))[None]).logits[0, -MORE:]
        cont = model(input_ids=torch.from_numpy(more)[None], use_cache=True, cache=loaded.cache).logits[0]
        assert rel_err(cont, full) < 1e-4
        # and one token at a time (decode): the cache's counts and buffers carry on
        step = load_kv(path).cache
        for j, tok in enumerate(more.tolist()):
            logits = model(input_ids=torch.tensor([[tok]]), use_cache=True, cache=step).logits[0, -1]
            assert rel_err(logits, full[j]) < 1e-4, j
    assert loaded.cache.get_seq_length() == step.get_seq_length() == PRE + NEW + MORE
    assert loaded.cache.layers[1].entry_count["indexer"] == (PRE + NEW + MORE) // 4


def test_bfloat16_export_keeps_float32_gates_through_files_and_the_flat_layout(folder, tmp_path):
    """A bfloat16 export: its overlap gates float32 (as transformers keeps them), the
    rest bfloat16, near transformers' bfloat16 cache; the file and the transport's flat
    layout (each span's bytes at its runs, then unflattened) give back the same bits."""
    (exports, _), = _export(CPGroup(), folder, "bfloat16", ("zigzag",))
    caches = _hf_caches(_model(folder, "bfloat16"))
    e = exports[0]
    _check(e, caches[0], PRE + NEW, TOL["bfloat16"], "bf16")
    m = e.meta
    assert {n: m.tensor_dtype(1, n) for n in ("overlap_gate", "index_overlap_gate", "overlap_kv")} == {
        "overlap_gate": torch.float32, "index_overlap_gate": torch.float32, "overlap_kv": torch.bfloat16}
    back = read_kv(save_kv(e, tmp_path / "bf16.safetensors"))
    assert back.meta == m and all(torch.equal(back.tensor(i, n), e.tensor(i, n)) for i, n in m.tensors())
    flat = torch.zeros(m.nbytes, dtype=torch.uint8)
    for i, n in m.tensors():
        t = e.tensor(i, n).contiguous().view(-1).view(torch.uint8)
        for src, dst, nbytes in m.span_runs(i, n, 0, m.num_tokens):
            flat[dst:dst + nbytes] = t[src:src + nbytes]
    views = m.unflatten(flat)
    assert all(torch.equal(views[i][n], e.tensor(i, n)) for i, n in m.tensors())
    with pytest.raises(KVFormatError, match=r"a span must be layer 1's whole request \(positions 0..51\)"):
        m.span_runs(1, "window", 0, 7)


@pytest.mark.skipif(mooncake_problem() is not None, reason=f"Mooncake transport unavailable: {mooncake_problem()}")
def test_mooncake_carries_the_dsv4_format(folder, tmp_path):
    from test_pd_mooncake import Receiver

    rx = Receiver("good", tmp_path, ["v4"], timeout_s=120)
    pre, new, *_ = _tokens()
    rt = RuntimeConfig(dtype="bfloat16", kv_tokens=1024, graph="off")
    sent = launch(send_export, 2, folder, rx.address, rt, pre, new, "v4")[0]
    got = rx.results()
    assert got["v4"] == ("ok", ""), got
    recv = read_kv(tmp_path / "v4.safetensors")
    assert recv.meta == sent.meta and recv.meta.dtype == "bfloat16"
    assert all(torch.equal(recv.tensor(i, n), sent.tensor(i, n)) for i, n in sent.meta.tensors())


def test_prefill_command_exports_dsv4_files_at_cp2(folder, tmp_path, capsys):
    """``graphcp prefill --export-kv DIR --cp 2`` on a V4 model: one graphcp-dsv4/1 file a
    request (one extending a cached prefix), loadable as transformers' cache."""
    from graphcp.cli.main import main

    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps({"tokens": list(range(5, 60))}) + "\n"
                    + json.dumps({"tokens": list(range(100, 140)), "prefix": 21}) + "\n")
    code = main([str(a) for a in ("prefill", "--model", folder, "--input", reqs, "--output", tmp_path / "o.pt",
                                  "--cp", 2, "--graph", "off", "--kv-tokens", 512, "--export-kv", tmp_path / "kv")])
    assert code == 0, capsys.readouterr().err[-2000:]
    logits = torch.load(tmp_path / "o.pt")["last_logits"]
    for i, n in enumerate((55, 40)):
        kv = load_kv(tmp_path / "kv" / f"{i}.safetensors")
        assert isinstance(kv.export, DsV4Export) and kv.num_tokens == n and kv.cache.get_seq_length() == n
        assert kv.cache.layers[2].entry_count["compressor"] == n // 8
        assert torch.equal(kv.export.last_logits, logits[i])


def test_malformed_dsv4_files_are_refused_naming_what_is_wrong(folder, tmp_path):
    (exports, _), = _export(CPGroup(), folder, "float32", ("zigzag",))
    e = exports[0]
    good = e.meta.to_dict()
    assert good["layer_kinds"] == "sliding,csa,hca" and DsV4Meta.from_dict(good) == e.meta
    tensors = {f"{n}.{i}": e.tensor(i, n).contiguous() for i, n in e.meta.tensors()}
    for name, meta, ts, says in (
        ("bad-kind", {**good, "layer_kinds": "sliding,csa,mla"}, tensors,
         r"layer_kinds must be 3 of \['sliding', 'csa', 'hca'\], got \['sliding', 'csa', 'mla'\]"),
        ("no-window", {k: v for k, v in good.items() if k != "sliding_window"}, tensors,
         r"missing DeepSeek V4 KV metadata \['sliding_window'\]"),
        ("bad-format", {**good, "format": "graphcp-dsv4/9"}, tensors, "format 'graphcp-dsv4/9' is none of"),
        ("no-overlap", good, {k: v for k, v in tensors.items() if k != "overlap_gate.1"},
         r"missing tensors \['overlap_gate.1'\]"),
        ("half-gate", good, {**tensors, "overlap_gate.1": tensors["overlap_gate.1"].half()},
         r"overlap_gate.1 is \(4, 32\) torch.float16, expected \(4, 32\) torch.float32"),
        ("short", good, {**tensors, "buffer_kv.2": tensors["buffer_kv.2"][:-1]}, r"buffer_kv.2 is \(2, 32\)"),
    ):
        path = tmp_path / f"{name}.safetensors"
        save_file(ts, str(path), metadata=meta)
        with pytest.raises(KVFormatError, match=says):
            read_kv(path)
