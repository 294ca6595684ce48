"""Acceptance: a transformers model continues a request from graphcp's exported KV.

For Llama, Mistral, Qwen2 and Qwen3 checkpoints, at CP 1, 2 and 4, with the replicated,
the layer-split and the token-sharded cache (one launch per CP size looping over them;
layer-split at CP 1 is the replicated cache plus a scratch layer, so it is left out
there), a batch of two requests (one extending a cached prefix in
the prefix variant) is prefilled and exported (``export_kv_batch``, through a
safetensors file and ``load_kv``). transformers then takes the export as its cache and
the next token as input: its logits must equal, within 1e-4 relative in float32 (2e-2
in bfloat16), transformers' own run over the whole sequence, and 8 greedy tokens
continued from the exported cache must equal transformers' own greedy continuation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FAMILIES
from helpers import rel_err

from graphcp import PrefillEngine, RuntimeConfig
from graphcp.dist import launch, run_ranks
from graphcp.pd import load_kv
from graphcp.pd.files import save_kv
from graphcp.pd.hf import greedy_continue
from graphcp.runtime.engine import prefill_after_prefixes

TOL = {"float32": 1e-4, "bfloat16": 2e-2}
STEPS = 8
#: (prefix, new) lengths of the batch's two requests; prefix 0: no cached prefix
VARIANTS = {"no-prefix": [(0, 70), (0, 9)], "prefix": [(29, 41), (0, 9)]}


def _requests(vocab: int, variant: str, seed: int) -> list[tuple[np.ndarray | None, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, p) if p else None, rng.integers(0, vocab, n)) for p, n in VARIANTS[variant]]


def _prefill_and_export(group, cases, modes):
    """On every rank: per cache mode, for each (folder, dtype, variant, seed), prefill the
    batch and export every request to rank 0; rank 0 returns the exports."""
    out = {}
    for kv_cache in modes:
        out[kv_cache] = []
        for folder, dtype, variant, seed in cases:
            engine = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=1024, kv_cache=kv_cache), group)
            res = prefill_after_prefixes(engine, _requests(engine.cfg.vocab_size, variant, seed))
            exports = engine.export_kv_batch(res.handles, dst=0)
            assert [h.num_tokens for h in res.handles] == [p + n for p, n in VARIANTS[variant]]
            out[kv_cache].append(exports)
    return out if group.rank == 0 else None


@torch.inference_mode()
def _reference(model, tokens: np.ndarray) -> tuple[int, torch.Tensor, list[int]]:
    """transformers alone: the next token after ``tokens``, the logits after it (over the
    whole sequence) and the greedy continuation after it."""
    ids = torch.from_numpy(tokens).view(1, -1)
    nxt = int(model(input_ids=ids).logits[0, -1].argmax())
    full = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    logits = model(input_ids=full).logits[0, -1].float()
    gen = model.generate(full, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return nxt, logits, gen[0, full.shape[1]:].tolist()


@pytest.fixture(scope="module")
def references(hf_model):
    cache: dict = {}

    def get(folder, dtype, variant, seed, j):
        key = (str(folder), dtype, variant, seed, j)
        if key not in cache:
            model = hf_model(folder, dtype)
            prefix, new = _requests(model.config.vocab_size, variant, seed)[j]
            tokens = new if prefix is None else np.concatenate([prefix, new])
            cache[key] = _reference(model, tokens)
        return cache[key]

    return get


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_transformers_continues_from_the_export(cp, hf_model_dir, hf_model, references, tmp_path):
    cases = [(hf_model_dir(f, False, "float32"), "float32", v, i) for i, f in enumerate(FAMILIES) for v in VARIANTS]
    if cp == 2:  # bfloat16 once: the export keeps the model dtype, and transformers continues in it
        cases.append((hf_model_dir("qwen3", False, "bfloat16"), "bfloat16", "prefix", 7))
    modes = ("replicated", "sharded") if cp == 1 else ("replicated", "layer-split", "sharded")
    results = (run_ranks(_prefill_and_export, 1, cases, modes) if cp == 1
               else launch(_prefill_and_export, cp, cases, modes)[0])
    assert list(results) == list(modes)
    for kv_cache, per_case in results.items():
        for (folder, dtype, variant, seed), exports in zip(cases, per_case):
            for j, export in enumerate(exports):
                where = f"{kv_cache} {folder.name} {variant} request {j}"
                path = save_kv(export, tmp_path / f"{kv_cache}-{seed}-{variant}-{j}.safetensors")
                loaded = load_kv(path)  # through the file transport, as a decode side reads it
                assert loaded.export.meta.dtype == dtype and loaded.num_tokens == export.meta.num_tokens, where
                assert all(torch.equal(a, b) for a, b in zip(loaded.export.k + loaded.export.v, export.k + export.v))
                nxt, ref_logits, ref_tokens = references(folder, dtype, variant, seed, j)
                tokens, logits = greedy_continue(hf_model(folder, dtype), loaded.cache, nxt, STEPS)
                assert rel_err(logits, ref_logits) < TOL[dtype], where
                if dtype == "float32":
                    assert tokens == ref_tokens, where
                assert loaded.cache.get_seq_length() == export.meta.num_tokens + STEPS, where


@pytest.mark.parametrize("version,known", [("5.23.0", False), ("5.24.0", True), ("5.25.0", True), ("5.25.3", True),
                                           ("5.26.0", False), ("6.0.0", False), ("4.57.1", False), ("main", False)])
def test_the_loader_names_the_transformers_releases_it_knows(version, known):
    """A release whose caches graphcp does not know how to build is one line naming the ones
    it knows, not a cache that continues at the wrong positions."""
    from graphcp.pd.hf import UnknownTransformers, check_transformers

    if known:
        check_transformers(version)
        return
    with pytest.raises(UnknownTransformers) as e:
        check_transformers(version)
    assert str(e.value) == (f'transformers {version} is not a release graphcp\'s KV loader knows (it knows 5.24 to '
                            f'5.25): pip install "transformers>=5.24,<5.26"')


def test_load_kv_refuses_an_unknown_transformers(monkeypatch, tmp_path):
    import transformers

    from graphcp.pd.export import KVExport, KVMeta
    from graphcp.pd.hf import UnknownTransformers

    meta = KVMeta(num_tokens=3, num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", page_size=16,
                  fingerprint="f")
    path = save_kv(KVExport(meta, [torch.zeros(1, 3, 2)], [torch.zeros(1, 3, 2)]), tmp_path / "kv.safetensors")
    monkeypatch.setattr(transformers, "__version__", "5.26.0")
    with pytest.raises(UnknownTransformers, match=r"transformers 5\.26\.0 is not a release"):
        load_kv(path)
