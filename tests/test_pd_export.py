"""engine.export_kv: the layout, assembly from each cache mode's spans (no traffic for a
replicated cache, owner sends or broadcasts for a layer-split or token-sharded one),
nothing released, the file transport's round trip and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import kv_cache

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch
from graphcp.kv.handle import KVHandleError
from graphcp.kv.layout import kv_cache_views
from graphcp.kv.spans import KVSpan, position_runs, position_spans
from graphcp.pd import KVFormatError, load_kv
from graphcp.pd.export import KVMeta
from graphcp.pd.files import read_kv, save_kv

LENS = [37, 5]


def _exports(group, folder, mode):
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=256, kv_cache=mode), group)
    rng = np.random.default_rng(3)
    out = eng.prefill([Request(rng.integers(0, eng.cfg.vocab_size, n)) for n in LENS])
    to_all = eng.export_kv_batch(out.handles)
    to_0 = eng.export_kv_batch(out.handles, dst=0)
    # exporting released nothing: the handle still extends, and exports again the same
    more = eng.prefill([Request([1, 2, 3], out.handles[1])]).handles[0]
    again = eng.export_kv(more)
    eng.release(more)
    try:
        eng.export_kv(more)
        released = None
    except KVHandleError as e:
        released = str(e)
    return to_all, to_0, again, released


#: float32 K/V of magnitude ~4 after a layer whose attention was merged differently
#: (ring LSE merge, other matmul shapes): ~2e-6 apart in absolute terms on some CPUs
ATOL = 1e-5


def _kv(e):
    return e.k + e.v


def test_export_assembles_the_same_kv_on_every_rank_and_mode(hf_model_dir):
    folder = hf_model_dir("qwen2", False, "float32")
    ref = PrefillEngine(folder, RuntimeConfig(kv_tokens=256))  # one rank
    rng = np.random.default_rng(3)
    one = ref.export_kv_batch(ref.prefill([Request(rng.integers(0, ref.cfg.vocab_size, n)) for n in LENS]).handles)
    want = launch(_exports, 2, folder, "replicated")[0][0]  # rank 0 of the replicated cache: the reference
    for w, o in zip(want, one):  # CP 2 against one rank: the same KV up to matmul rounding
        assert w.meta == o.meta and w.meta.shape == (2, o.meta.num_tokens, 16)
        assert all(torch.allclose(x, y, rtol=1e-5, atol=ATOL) for x, y in zip(_kv(w), _kv(o)))
    for mode in ("replicated", "layer-split"):
        for rank, (to_all, to_0, again, released) in enumerate(launch(_exports, 2, folder, mode)):
            for w, a in zip(want, to_all):
                assert a.meta == w.meta and all(torch.equal(x, y) for x, y in zip(_kv(a), _kv(w))), (mode, rank)
            if rank == 0:
                assert all(torch.equal(x, y) for a, w in zip(to_0, want) for x, y in zip(_kv(a), _kv(w)))
            else:
                assert to_0 == [None, None]
            assert again.meta.num_tokens == LENS[1] + 3
            assert all(torch.equal(x[:, :LENS[1]], y) for x, y in zip(_kv(again), _kv(want[1])))
            assert "not live" in released
    # the token-sharded cache: each rank exports the positions it stored (a second chunk
    # too); its K/V equal the replicated engine's up to the ring's merge rounding, and
    # every rank assembles the same bits
    sharded = launch(_exports, 2, folder, "sharded")
    for rank, (to_all, to_0, again, released) in enumerate(sharded):
        for w, a, s0 in zip(want, to_all, sharded[0][1]):
            assert a.meta == w.meta and all(torch.allclose(x, y, rtol=1e-5, atol=ATOL) for x, y in zip(_kv(a), _kv(w)))
            assert all(torch.equal(x, y) for x, y in zip(_kv(a), _kv(s0))), rank
        assert to_0 == [None, None] if rank else all(e is not None for e in to_0)
        assert all(torch.allclose(x[:, :LENS[1]], y, rtol=1e-5, atol=ATOL) for x, y in zip(_kv(again), _kv(want[1])))
        assert "not live" in released


@pytest.mark.parametrize("cp", [2, 3])
def test_sharded_spans_cover_each_position_once_from_the_rank_that_stored_it(cp):
    """C simulated ranks of a token-sharded cache; every stored slot holds its own
    position (+ 1000 x layer): the spans partition (layer, position), each owned by the
    rank that stored it, and read_span on the owner returns exactly those positions."""
    layers, page = 2, 4
    caches = [kv_cache("sharded", layers, 64, page, 2, 3, cp_size=cp, rank=r) for r in range(cp)]
    handles = [None] * cp
    for cached, new in ((0, 37), (37, 5), (42, 1), (43, 20)):  # four chunks, one a single token
        ids = [c.extend([h], [new]) for c, h in zip(caches, handles)]
        handles = [c.handle(i[0]) for c, i in zip(caches, ids)]
    total = handles[0].num_tokens
    for r, (c, h) in enumerate(zip(caches, handles)):
        held = h.positions(r)
        local = np.arange(len(held))
        where = (torch.from_numpy(np.asarray(h.pages, dtype=np.int64)[local // page]), torch.from_numpy(local % page))
        for layer in range(layers):
            k, v = kv_cache_views(c.layer(layer), c.layout)  # [pages, page, H, D] views of the pool
            value = torch.from_numpy(held + 1000 * layer).float().view(-1, 1, 1)
            k[where], v[where] = value, -value
    spans = caches[0].kv_spans(handles[0], cp)
    assert all(c.kv_spans(h, cp) == spans for c, h in zip(caches, handles))  # the same on every rank
    for layer in range(layers):
        mine = [s for s in spans if s.layer == layer]
        assert [(s.start, s.stop) for s in mine] == sorted((s.start, s.stop) for s in mine)
        assert np.array_equal(np.concatenate([np.arange(s.start, s.stop) for s in mine]), np.arange(total))
        for s in mine:
            assert set(np.arange(s.start, s.stop)) <= set(handles[s.owner].positions(s.owner).tolist())
            assert [c.holds(s, r) for r, c in enumerate(caches)] == [r == s.owner for r in range(cp)]
            ks, vs = caches[s.owner].read_span(handles[s.owner], s)
            want = torch.arange(s.start, s.stop).float() + 1000 * layer
            assert ks.shape == (2, s.num_tokens, 3) and torch.equal(ks[1, :, 2], want) and torch.equal(vs[0, :, 0], -want)
    assert len(spans) > layers * 2 * cp  # runs from several chunks, not one per rank
    other = next(s for s in spans if s.owner != 0)
    with pytest.raises(ValueError, match="rank 0 does not hold position"):
        caches[0].read_span(handles[0], KVSpan(0, other.start, other.stop, other.owner))


def test_keys_are_after_rope_as_transformers_caches_them(hf_model_dir, hf_model):
    folder = hf_model_dir("llama", False, "float32")
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=256))
    toks = torch.arange(3, 40)
    export = eng.export_kv(eng.prefill([Request(toks)]).handles[0])
    with torch.inference_mode():
        out = hf_model(folder, "float32")(input_ids=toks.view(1, -1), use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    for i in range(export.meta.num_layers):
        assert torch.allclose(export.k[i], cache.layers[i].keys[0], rtol=1e-5, atol=1e-5)
        assert torch.allclose(export.v[i], cache.layers[i].values[0], rtol=1e-5, atol=1e-5)


def test_file_round_trip_and_refusals(hf_model_dir, tmp_path):
    eng = PrefillEngine(hf_model_dir("qwen3", False, "bfloat16"), RuntimeConfig(dtype="bfloat16", kv_tokens=256))
    export = eng.export_kv(eng.prefill([Request([4, 5, 6, 7])]).handles[0])
    export.token_ids = torch.tensor([4, 5, 6, 7])
    path = save_kv(export, tmp_path / "0.safetensors")
    back = read_kv(path)
    assert back.meta == export.meta and back.meta.dtype == "bfloat16" and torch.equal(back.token_ids, export.token_ids)
    assert all(torch.equal(x, y) for x, y in zip(_kv(back), _kv(export)))
    assert load_kv(path).cache.get_seq_length() == 4
    meta = export.meta
    assert meta.offset(1, 1, 1, 2) == (3 * meta.tensor_bytes) + (1 * 4 + 2) * meta.head_dim * 2
    assert meta.nbytes == 2 * meta.num_layers * meta.tensor_bytes
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(KVFormatError, match="bad.safetensors: not a readable safetensors file"):
        read_kv(tmp_path / "bad.safetensors")
    with pytest.raises(KVFormatError, match="no such KV file"):
        read_kv(tmp_path / "missing.safetensors")
    with pytest.raises(KVFormatError, match="dtype must be one of"):
        KVMeta.from_dict({**meta.to_dict(), "dtype": "int8"})
    with pytest.raises(KVFormatError, match="missing KV metadata"):
        KVMeta.from_dict({"num_tokens": "3"})


def test_position_spans_split_each_rank_s_positions_into_runs():
    """The spans of a cache that keeps each position on one rank: zigzag blocks of two
    chunks at C = 2 (rank 0: [0, 3) + [9, 12) of the first 12, rank 1 the middle; then
    a 5-token chunk), adjacent blocks of one rank merged, every position once."""
    held = [np.array([0, 1, 2, 9, 10, 11, 12, 16]), np.array([3, 4, 5, 6, 7, 8, 13, 14, 15])]
    assert position_runs(held[0]) == [(0, 3), (9, 13), (16, 17)] and position_runs(np.array([], dtype=np.int64)) == []
    spans = position_spans(2, held)
    assert [(s.start, s.stop, s.owner) for s in spans if s.layer == 1] == [
        (0, 3, 0), (3, 9, 1), (9, 13, 0), (13, 16, 1), (16, 17, 0)]
    assert [s.layer for s in spans] == [0] * 5 + [1] * 5 and all(isinstance(s, KVSpan) for s in spans)
