"""Bad input is rejected with a message that says what and where, and leaves the KV
cache exactly as it was (allocator state and pool contents); the CLI turns the same
errors into exit code 2 with the message on stderr. Also the paged KV cache's own
allocation behaviour."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import kv_cache, rel_err

from graphcp import BatchError, PrefillEngine, Request
from graphcp.cli.main import main
from graphcp.cli.requests import RequestFileError, parse_requests
from graphcp.config import RuntimeConfig
from graphcp.kv.handle import KVCacheFull, KVHandle, KVHandleError
from graphcp.kv.layout import write_kv
from graphcp.kv.page_table import SCRATCH_PAGE
from graphcp.kv.paged import PagedKVCache
from graphcp.runtime.outputs import OutputHead

VOCAB = 512
PAGE = 16
SMALL_POOL = 256  # tokens: 16 usable pages


@pytest.fixture(scope="module")
def model_dir(hf_model_dir) -> Path:
    return hf_model_dir("qwen2", False, "float32")


@pytest.fixture(scope="module")
def engine(model_dir) -> PrefillEngine:
    """A small pool (16 pages of 16 tokens), so pool-size errors are cheap to reach."""
    return PrefillEngine(model_dir, RuntimeConfig(kv_tokens=SMALL_POOL, page_size=PAGE))


@pytest.fixture
def clean(engine):
    """Fails the test if it leaves sequences behind; releases them either way."""
    yield engine
    live = engine.parts.kv.snapshot()[1]
    for sid, n, pages in live:
        engine.parts.kv.release(KVHandle(sid, n, pages, engine.parts.kv.cache_id))
    assert not live, f"the test left live sequences: {live}"


def toks(n, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, n)


class Unchanged:
    """Context manager: the allocator state and the pool contents are the same on exit."""

    def __init__(self, engine):
        self.kv = engine.parts.kv

    def __enter__(self):
        self.snap = self.kv.snapshot()
        self.pool = self.kv.pool.clone()
        return self

    def __exit__(self, *exc):
        assert self.kv.snapshot() == self.snap, "the allocator state changed"
        assert torch.equal(self.kv.pool, self.pool), "the KV pool contents changed"
        return False


def _rejects(engine, batch, exc, match, **kw):
    with Unchanged(engine), pytest.raises(exc, match=match) as e:
        engine.prefill(batch, **kw)
    return str(e.value)


# ---- engine: the batch ---------------------------------------------------------------------
def test_empty_batch(clean):
    _rejects(clean, [], BatchError, r"empty batch")


def test_empty_request(clean):
    _rejects(clean, [Request(toks(3)), Request([])], BatchError, r"request 1 is empty")
    _rejects(clean, [Request(np.zeros(0, dtype=np.int64))], BatchError, r"request 0 is empty")


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 100, -1])
def test_token_outside_vocabulary_names_request_and_position(clean, bad):
    t = toks(20)
    t[13] = bad
    msg = _rejects(clean, [Request(toks(5)), Request(toks(4)), Request(t)], BatchError,
                   r"request 2, position 13: token id")
    assert str(bad) in msg and f"[0, {VOCAB})" in msg


def test_token_ids_must_be_integers_in_one_dim(clean):
    _rejects(clean, [Request(np.ones(4, dtype=np.float32))], BatchError, r"request 0: tokens must be a 1-D")
    _rejects(clean, [Request(toks(3)), Request(torch.ones(2, 3, dtype=torch.long))], BatchError,
             r"request 1: tokens must be a 1-D")


def test_released_prefix_handle(clean):
    out = clean.prefill([Request(toks(40))])
    h = out.handles[0]
    clean.release(h)
    msg = _rejects(clean, [Request(toks(5), prefix=h)], BatchError, r"^request 0: KV handle .*not live")
    assert f"seq_id={h.seq_id}" in msg and "released" in msg
    with pytest.raises(KVHandleError, match="not live"):
        clean.release(h)  # twice


def test_stale_prefix_handle(clean):
    a = clean.prefill([Request(toks(40))]).handles[0]
    b = clean.prefill([Request(toks(8, 1), prefix=a)]).handles[0]
    try:
        assert b.seq_id == a.seq_id and b.num_tokens == 48
        msg = _rejects(clean, [Request(toks(3)), Request(toks(5), prefix=a)], BatchError, r"request 1: .*stale")
        assert "holds 40 tokens" in msg and "now holds 48" in msg
    finally:
        clean.release(b)


def test_same_prefix_twice_in_one_batch(clean):
    a = clean.prefill([Request(toks(20))]).handles[0]
    try:
        # a BatchError like every refused batch, naming both requests
        _rejects(clean, [Request(toks(3), prefix=a), Request(toks(4), prefix=a)], KVHandleError,
                 r"requests 0 and 1 both extend KV handle")
    finally:
        clean.release(a)


def test_request_longer_than_the_context(hf_model_dir):
    short = hf_model_dir("qwen2", False, "float32", max_position_embeddings=256)
    big = PrefillEngine(short, RuntimeConfig(page_size=PAGE))  # the default pool: 4 x the context
    ctx = big.max_context
    assert ctx == 256 and big.parts.kv.capacity_tokens > ctx
    _rejects(big, [Request(toks(3)), Request(toks(ctx + 1))], BatchError,
             rf"request 1: 0 cached \+ {ctx + 1} new tokens exceed the model's context of {ctx}")
    # counting a cached prefix too
    h = big.prefill([Request(toks(ctx - 10))]).handles[0]
    _rejects(big, [Request(toks(11), prefix=h)], BatchError,
             rf"request 0: {ctx - 10} cached \+ 11 new tokens exceed the model's context")
    assert big.prefill([Request(toks(10), prefix=h)]).handles[0].num_tokens == ctx  # exactly the context: fine


def test_request_larger_than_the_pool(clean):
    assert clean.parts.kv.capacity_tokens == SMALL_POOL
    _rejects(clean, [Request(toks(SMALL_POOL + 1))], BatchError,
             rf"request 0: {SMALL_POOL + 1} tokens exceed the KV pool of {SMALL_POOL}")


def test_kv_cache_full_is_all_or_nothing(clean):
    """A batch one page too large allocates nothing (no half-allocated request); one
    that fits exactly succeeds, counting a prefix extension that stays inside the
    prefix's last page as needing no new page."""
    held = clean.prefill([Request(toks(100))]).handles[0]  # pages_for(100) = 7 -> 9 free
    out = None
    try:
        assert clean.parts.kv.num_free_pages == 9
        # 50 -> 4 pages, 65 -> 5, 100 + 13 = 113 -> 8 (1 more): 10 needed
        msg = _rejects(clean, [Request(toks(50)), Request(toks(65)), Request(toks(13), prefix=held)], KVCacheFull,
                       r"needs 10 more pages of 16 tokens, 9 are free")
        assert "16 usable pages" in msg
        # 50 -> 4, 80 -> 5, 100 + 12 = 112 -> 7 (0 more): exactly the 9 free pages
        out = clean.prefill([Request(toks(50)), Request(toks(80)), Request(toks(12), prefix=held)])
        held = out.handles[2]
        assert clean.parts.kv.num_free_pages == 0 and held.num_tokens == 112 and len(held.pages) == 7
        _rejects(clean, [Request(toks(1), prefix=held)], KVCacheFull, r"needs 1 more pages of 16 tokens, 0 are free")
        _rejects(clean, [Request(toks(1))], KVCacheFull, r"0 are free")
    finally:
        for h in (out.handles[:2] if out is not None else []):
            clean.release(h)
        clean.release(held)
    assert clean.parts.kv.num_free_pages == 16


def _seq_kv(kv: PagedKVCache, h: KVHandle) -> torch.Tensor:
    """[layers, 2, num_tokens, H, D] cached K/V of a sequence (NHD pool)."""
    assert kv.layout == "NHD"
    x = kv.pool[:, list(h.pages)]  # [L, pages, 2, ps, H, D]
    x = x.transpose(1, 2).flatten(2, 3)  # [L, 2, pages * ps, H, D]
    return x[:, :, : h.num_tokens]


def test_failure_inside_the_forward_rolls_back(clean, monkeypatch):
    """An error after the pages were reserved and the body wrote KV: the allocator is
    restored, the prefix's cached KV is untouched and still valid, and extending it
    afterwards gives the right logits."""
    full = toks(90, 5)
    ref = clean.prefill([Request(full)], all_logits=True)
    clean.release(ref.handles[0])
    a = clean.prefill([Request(full[:30])]).handles[0]
    snap = clean.parts.kv.snapshot()
    cached = _seq_kv(clean.parts.kv, a).clone()

    def boom(*args, **kw):
        raise RuntimeError("injected failure after the body")

    monkeypatch.setattr(OutputHead, "all_logits", boom)
    with pytest.raises(RuntimeError, match="injected"):
        clean.prefill([Request(toks(40)), Request(full[30:], prefix=a)], all_logits=True)
    monkeypatch.undo()
    assert clean.parts.kv.snapshot() == snap
    assert torch.equal(_seq_kv(clean.parts.kv, a), cached)
    b = clean.prefill([Request(full[30:], prefix=a)], all_logits=True)
    try:
        assert rel_err(b.logits[0], ref.logits[0][30:]) < 1e-5
    finally:
        clean.release(b.handles[0])


# ---- REQUESTS.jsonl ----------------------------------------------------------------------
def _jsonl(tmp_path, lines, name="req.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_parse_requests_round_trip(tmp_path):
    p = _jsonl(tmp_path, [{"tokens": [1, 2, 3]}, "", {"tokens": [4, 5, 6, 7], "prefix": 2}])
    reqs = parse_requests(p)
    assert [r.tokens for r in reqs] == [[1, 2, 3], [4, 5, 6, 7]]
    assert [r.prefix for r in reqs] == [0, 2] and reqs[1].new_tokens == [6, 7]


@pytest.mark.parametrize(
    "bad,match",
    [
        ('{"tokens": [1, 2', r"req.jsonl line 3: not valid JSON"),
        ('[1, 2, 3]', r"req.jsonl line 3: expected an object"),
        ('{"tokens": [1, 2.5]}', r'req.jsonl line 3: "tokens" must be a list of integer ids'),
        ('{"tokens": [1, true]}', r'req.jsonl line 3: "tokens" must be a list of integer ids'),
        ('{"tokens": []}', r"req.jsonl line 3: empty request"),
        ('{"tokens": [1, 2], "prefix": -1}', r'req.jsonl line 3: "prefix" must be an integer >= 0'),
        ('{"tokens": [1, 2], "prefix": 2}', r"req.jsonl line 3: prefix 2 is not shorter than the request's 2 tokens"),
        ('{"tokens": [1, 2], "prefix": 5}', r"req.jsonl line 3: prefix 5 is not shorter"),
        ('{"tokens": [1], "prefx": 0}', r"req.jsonl line 3: unknown keys \['prefx'\]"),
    ],
)
def test_malformed_jsonl_names_the_line(tmp_path, bad, match):
    # a blank line 2 still counts: the number is the file's line number
    p = _jsonl(tmp_path, [{"tokens": [1, 2, 3]}, "", bad, {"tokens": [4]}])
    with pytest.raises(RequestFileError, match=match):
        parse_requests(p)


def test_empty_or_missing_request_file(tmp_path):
    with pytest.raises(RequestFileError, match="no requests"):
        parse_requests(_jsonl(tmp_path, ["", "  "]))
    with pytest.raises(RequestFileError, match="cannot read"):
        parse_requests(tmp_path / "nope.jsonl")


# ---- the CLI: exit code 2, the message on stderr ----------------------------------------------
def _cli(capsys, model, req, tmp_path, *extra):
    out = tmp_path / "out.pt"
    code = main(["prefill", "--model", str(model), "--input", str(req), "--output", str(out), *extra])
    cap = capsys.readouterr()
    return code, cap.err, out


@pytest.mark.parametrize(
    "lines,extra,match",
    [
        (['{"tokens": [1, 2, 3]}', '{"tokens": [1, 2'], [], r"req.jsonl line 2: not valid JSON"),
        ([{"tokens": [1, 2, 3], "prefix": 3}], [], r"req.jsonl line 1: prefix 3 is not shorter"),
        ([{"tokens": [1, 2]}, {"tokens": [5, 6, 7, VOCAB + 3]}], [], r"req.jsonl line 2, position 3: token id 515"),
        ([{"tokens": [1] * 4097}], [], r"exceed the model's context of 4096"),
        ([{"tokens": [1] * 65}], ["--kv-tokens", "64"], r"65 tokens exceed the KV pool of 64"),
        ([{"tokens": [1] * 40}, {"tokens": [2] * 40}], ["--kv-tokens", "64"],
         r"KV cache full: the batch needs 6 more pages of 16 tokens, 4 are free"),
    ],
    ids=["bad-json", "prefix-too-long", "vocab", "context", "pool", "kv-full"],
)
def test_cli_bad_input_exits_2(capsys, tmp_path, model_dir, lines, extra, match):
    req = _jsonl(tmp_path, lines)
    code, err, out = _cli(capsys, model_dir, req, tmp_path, "--graph", "off", *extra)
    assert code == 2
    assert err.startswith("graphcp prefill: error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(match, err), err
    assert not out.exists()


def test_cli_bad_input_exits_2_on_the_default_graph_path(capsys, tmp_path, model_dir):
    req = _jsonl(tmp_path, [{"tokens": [1, 2, VOCAB]}])
    code, err, _ = _cli(capsys, model_dir, req, tmp_path)
    assert code == 2 and "req.jsonl line 1, position 2: token id 512" in err


def test_cli_missing_files_and_bad_model_exit_2(capsys, tmp_path, model_dir):
    req = _jsonl(tmp_path, [{"tokens": [1, 2]}])
    code, err, _ = _cli(capsys, model_dir, tmp_path / "missing.jsonl", tmp_path, "--graph", "off")
    assert code == 2 and "cannot read" in err and "missing.jsonl" in err
    code, err, _ = _cli(capsys, tmp_path / "no-such-model", req, tmp_path, "--graph", "off")
    assert code == 2 and "no-such-model" in err and "neither a preset" in err
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    code, err, _ = _cli(capsys, bad, req, tmp_path, "--graph", "off")
    assert code == 2 and "'GPT2LMHeadModel'" in err and "config.json" in err


# ---- the paged KV cache itself -----------------------------------------------------------
def _cache(num_pages=5, page_size=4) -> PagedKVCache:
    return kv_cache("replicated", 2, num_pages, page_size, 1, 2)


def test_page_zero_is_never_allocated():
    kv = _cache(num_pages=5, page_size=4)  # pages 1..4 usable: 16 tokens
    assert kv.capacity_tokens == 16 and kv.num_free_pages == 4
    before = kv.snapshot()
    with pytest.raises(KVCacheFull, match="needs 5 more pages of 4 tokens, 4 are free"):
        kv.extend([None, None, None], [5, 1, 6])  # 2 + 1 + 2 pages
    assert kv.snapshot() == before
    ids = kv.extend([None, None], [8, 7])  # exactly the pool
    pages = [p for i in ids for p in kv.handle(i).pages]
    assert sorted(pages) == [1, 2, 3, 4] and kv.num_free_pages == 0


def test_page_zero_is_never_allocated_in_any_order():
    kv = _cache(num_pages=5, page_size=4)
    seen = set()
    for n in (3, 4, 1, 4):  # one page each, the whole pool
        seen.update(kv.handle(kv.extend([None], [n])[0]).pages)
    assert seen == {1, 2, 3, 4} and SCRATCH_PAGE not in seen and kv.num_free_pages == 0
    with pytest.raises(KVCacheFull):
        kv.extend([None], [1])


def test_release_frees_pages_and_they_are_reused():
    kv = _cache(num_pages=9, page_size=4)
    a = kv.handle(kv.extend([None], [8])[0])
    b = kv.handle(kv.extend([None], [9])[0])
    assert len(a.pages) == 2 and len(b.pages) == 3 and not set(a.pages) & set(b.pages)
    assert kv.num_free_pages == 3
    kv.release(a)
    assert kv.num_free_pages == 5
    c = kv.handle(kv.extend([None], [7])[0])
    assert c.pages == a.pages  # LIFO: the freed pages come back first, in the same order
    assert c.seq_id != a.seq_id  # ids are not reused: a's handle stays dead
    with pytest.raises(KVHandleError, match="not live"):
        kv.check_handle(a)
    kv.release(b)
    kv.release(c)
    assert kv.num_free_pages == 8 and kv.snapshot() == (tuple(range(8, 0, -1)), ())


def test_rollback_restores_the_exact_state():
    kv = _cache(num_pages=12, page_size=4)
    p = kv.handle(kv.extend([None], [6])[0])  # 2 pages, last one half full
    before = kv.snapshot()
    ids = kv.extend([None, p, None], [5, 7, 1])  # 2 + (13 tokens: 4 pages, +2) + 1
    assert ids[1] == p.seq_id and kv.num_free_pages == before[0].__len__() - 5
    kv.rollback(ids, [5, 7, 1])
    assert kv.snapshot() == before
    kv.check_handle(p)  # the prefix is live and holds its 6 tokens again
    # new sequences of the rolled-back extend are gone
    with pytest.raises(KeyError):
        kv.handle(ids[0])


def test_check_handle_and_extend_validation():
    kv = _cache(num_pages=8, page_size=4)
    h = kv.handle(kv.extend([None], [3])[0])
    kv.extend([h], [2])
    with pytest.raises(ValueError, match="stale: it holds 3 tokens, the cache now holds 5"):
        kv.check_handle(h)
    h2 = kv.handle(h.seq_id)
    before = kv.snapshot()
    with pytest.raises(ValueError, match="prefix of two requests"):
        kv.extend([h2, h2], [1, 1])
    with pytest.raises(ValueError, match="same length"):
        kv.extend([None], [1, 2])
    assert kv.snapshot() == before
    with pytest.raises(ValueError, match="num_pages must be >= 2"):
        kv_cache("replicated", 1, 1, 4, 1, 2)


def test_page_table_and_slots():
    kv = _cache(num_pages=8, page_size=4)
    a = kv.extend([None], [9])[0]  # 3 pages
    b = kv.extend([None], [2])[0]  # 1 page
    pt = kv.page_table([a, b])
    pa, pb = kv.handle(a).pages, kv.handle(b).pages
    assert pt.dtype == np.int32 and pt.shape == (2, 3)
    assert pt[0].tolist() == list(pa) and pt[1].tolist() == [pb[0], SCRATCH_PAGE, SCRATCH_PAGE]
    rows, pos = np.array([0, 0, 0, 1]), np.array([0, 5, 8, 1])
    want = [pa[0] * 4, pa[1] * 4 + 1, pa[2] * 4, pb[0] * 4 + 1]
    ones = np.ones(4, dtype=np.int64)
    assert kv.slots(kv.table_rows([a, b]), pos, rows, ones).tolist() == want
    # requests index table rows: the same tokens with the batch order swapped
    assert kv.slots(kv.table_rows([b, a]), pos, 1 - rows, ones).tolist() == want
    # runs of consecutive tokens: a's first 6 positions and b's 2
    want = [pa[p // 4] * 4 + p % 4 for p in range(6)] + [pb[0] * 4, pb[0] * 4 + 1]
    got = kv.slots(kv.table_rows([a, b]), np.array([0, 1, 2, 3, 4, 5, 0, 1]), np.array([0, 1]), np.array([6, 2]))
    assert got.tolist() == want
    # a page size that is not a power of two takes the division path
    kv3 = _cache(num_pages=8, page_size=3)
    c = kv3.extend([None], [7])[0]
    pc = kv3.handle(c).pages
    got = kv3.slots(kv3.table_rows([c]), np.arange(7), np.array([0]), np.array([7]))
    assert got.tolist() == [pc[p // 3] * 3 + p % 3 for p in range(7)]
    with pytest.raises(ValueError, match="3 pages, page table width is 2"):
        kv.page_table([a], width=2)


def test_write_kv_sends_padding_to_the_scratch_page():
    kv = _cache(num_pages=4, page_size=4)
    layer = kv.layer(1)
    k = torch.arange(3 * 2, dtype=torch.float32).view(3, 1, 2) + 1
    v = -k
    write_kv(layer, k, v, torch.tensor([5, -1, 9]), "NHD")
    torch.testing.assert_close(layer[1, 0, 1], k[0])  # slot 5 = page 1, offset 1
    torch.testing.assert_close(layer[2, 1, 1], v[2])  # slot 9 = page 2, offset 1
    assert layer[SCRATCH_PAGE].abs().sum() > 0  # the padding row went to scratch ...
    real = layer.clone()
    real[SCRATCH_PAGE] = 0
    real[1, :, 1] = 0
    real[2, :, 1] = 0
    assert real.abs().sum() == 0  # ... and nowhere else
    assert kv.layer(0).abs().sum() == 0  # other layers untouched
