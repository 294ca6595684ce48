"""graphcp against transformers: every supported family (Llama with llama3 RoPE
scaling, Mistral, Qwen2, Qwen3), tied and untied embeddings, float32 and bfloat16.

The reference is transformers' own forward of the same checkpoint folder, loaded in
the same dtype and run on each request alone; graphcp runs the requests as one
mixed batch (lengths 1..300), and in chunks that extend a cached prefix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FAMILIES
from helpers import rel_err

from graphcp import PrefillEngine, Request
from graphcp.config import RuntimeConfig

#: relative error (Frobenius) of graphcp's logits against transformers'
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
MIXED_LENS = [1, 17, 300, 64, 2]
KV_TOKENS = 2048  # the tests' pool (the default sizes it for 4 x max_position_embeddings)


def _tokens(lens, vocab, seed):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(0, vocab, n)) for n in lens]


@torch.inference_mode()
def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits of one request run alone, float32 [len, vocab]."""
    return model(input_ids=tokens.view(1, -1)).logits[0].float()


def _engine(folder, dtype, **kw) -> PrefillEngine:
    return PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=KV_TOKENS, **kw))


@pytest.fixture(scope="module")
def engines():
    """One engine per checkpoint folder and dtype for the whole module (each test
    releases what it prefilled, so the pool is shared safely)."""
    cache = {}

    def get(folder, dtype):
        key = (str(folder), dtype)
        if key not in cache:
            cache[key] = _engine(folder, dtype)
        return cache[key]

    return get


def _release_all(engine, handles):
    for h in handles:
        engine.release(h)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_matches_transformers(family, tied, dtype, hf_model_dir, hf_model, engines):
    folder = hf_model_dir(family, tied, dtype)
    engine = engines(folder, dtype)
    ref_model = hf_model(folder, dtype)
    assert engine.cfg.family == family and engine.cfg.tie_word_embeddings == tied
    free0 = engine.parts.kv.num_free_pages

    toks = _tokens(MIXED_LENS, engine.cfg.vocab_size, seed=2 * FAMILIES.index(family) + tied)
    out = engine.prefill([Request(t) for t in toks], all_logits=True)
    try:
        assert out.last_logits.dtype == torch.float32
        assert out.last_logits.shape == (len(toks), engine.cfg.vocab_size)
        assert [h.num_tokens for h in out.handles] == MIXED_LENS
        for j, (t, got) in enumerate(zip(toks, out.logits)):
            ref = hf_logits(ref_model, t)
            assert got.dtype == torch.float32 and got.shape == ref.shape, j
            err = rel_err(got, ref)
            assert err < TOL[dtype], f"request {j} (len {len(t)}): relative error {err:.3g} > {TOL[dtype]}"
            # the first-token logits are the last row of the all-token logits (the LM head
            # runs on a different number of rows, so equal up to the matmul's rounding)
            assert rel_err(out.last_logits[j], got[-1]) < TOL[dtype] / 10
    finally:
        _release_all(engine, out.handles)
    assert engine.parts.kv.num_free_pages == free0


@pytest.mark.parametrize(
    "family,dtype",
    [(f, "float32") for f in FAMILIES] + [("qwen3", "bfloat16"), ("llama", "bfloat16")],
)
def test_chunked_prefill_matches_one_shot_and_transformers(family, dtype, hf_model_dir, hf_model, engines):
    """A 300-token request prefilled in 3 chunks (each passing the previous handle as
    its prefix; chunk boundaries off the page grid) equals one shot and transformers.
    The second chunk shares its batch with a fresh request, the third with a 2-chunk one."""
    folder = hf_model_dir(family, False, dtype)
    engine = engines(folder, dtype)
    ref_model = hf_model(folder, dtype)
    tol = TOL[dtype]
    vocab = engine.cfg.vocab_size
    full, other, pair = _tokens([300, 40, 90], vocab, seed=7)
    cuts = [0, 37, 251, 300]

    one = engine.prefill([Request(full)], all_logits=True)
    one_shot = one.logits[0]
    _release_all(engine, one.handles)
    ref = hf_logits(ref_model, full)
    assert rel_err(one_shot, ref) < tol

    free0 = engine.parts.kv.num_free_pages
    chunks = []
    held = []
    try:
        a = engine.prefill([Request(full[: cuts[1]]), Request(pair[:50])], all_logits=True)
        held = list(a.handles)
        chunks.append(a.logits[0])
        b = engine.prefill([Request(other), Request(full[cuts[1]: cuts[2]], prefix=a.handles[0])], all_logits=True)
        held = [b.handles[0], b.handles[1], a.handles[1]]
        assert b.handles[1].seq_id == a.handles[0].seq_id and b.handles[1].num_tokens == cuts[2]
        chunks.append(b.logits[1])
        c = engine.prefill([Request(pair[50:], prefix=a.handles[1]), Request(full[cuts[2]:], prefix=b.handles[1])],
                           all_logits=True)
        held = [b.handles[0], *c.handles]
        chunks.append(c.logits[1])
        assert c.handles[1].num_tokens == 300

        chunked = torch.cat(chunks)
        assert chunked.shape == one_shot.shape
        # same cached K/V, only the query blocking differs: much closer than the HF tolerance in float32
        assert rel_err(chunked, one_shot) < (tol / 10 if dtype == "float32" else tol)
        assert rel_err(chunked, ref) < tol
        # the companions of the chunks are right too (a fresh request; a 2-chunk request)
        assert rel_err(b.logits[0], hf_logits(ref_model, other)) < tol
        assert rel_err(c.logits[0], hf_logits(ref_model, pair)[50:]) < tol
        assert rel_err(torch.cat([a.logits[1], c.logits[0]]), hf_logits(ref_model, pair)) < tol
    finally:
        _release_all(engine, held)
    assert engine.parts.kv.num_free_pages == free0


def test_default_preset_loads_in_transformers_and_matches(default_model_dir, hf_model):
    """The built-in preset is a real HF checkpoint: transformers loads the folder
    (no missing / unexpected weights) and agrees with graphcp."""
    from transformers import AutoModelForCausalLM

    ref_model, info = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32,
                                                           output_loading_info=True)
    ref_model.eval()
    assert all(not v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    engine = _engine(default_model_dir, "float32")
    assert engine.cfg.family == "qwen3"
    toks = _tokens([1, 17, 300], engine.cfg.vocab_size, seed=3)
    out = engine.prefill([Request(t) for t in toks], all_logits=True)
    for j, (t, got) in enumerate(zip(toks, out.logits)):
        err = rel_err(got, hf_logits(ref_model, t))
        assert err < TOL["float32"], f"request {j}: relative error {err:.3g}"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_interleave_layout_matches_transformers(family, hf_model_dir, hf_model):
    """The interleave layout (one-row segments) on the same mixed batch, with one request
    extending a cached prefix."""
    folder = hf_model_dir(family, False, "float32")
    engine = _engine(folder, "float32", layout="interleave")
    ref_model = hf_model(folder, "float32")
    toks = _tokens(MIXED_LENS, engine.cfg.vocab_size, seed=11)
    pre = engine.prefill([Request(toks[2][:100])]).handles[0]
    out = engine.prefill([Request(t[100:] if j == 2 else t, prefix=pre if j == 2 else None)
                          for j, t in enumerate(toks)], all_logits=True)
    for j, (t, got) in enumerate(zip(toks, out.logits)):
        ref = hf_logits(ref_model, t)[100:] if j == 2 else hf_logits(ref_model, t)
        assert rel_err(got, ref) < TOL["float32"], j
