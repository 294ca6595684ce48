"""One request's eager prefill, graphcp (CP 1) against transformers' forward
(``logits_to_keep=1``) on the same checkpoint: the comparison the model-family
benchmarks share (bench_dsa.py, bench_dsv4.py). The transformers case stores
``graphcp_over_transformers_medians`` when the graphcp case ran first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphcp import PrefillEngine, Request
from graphcp.config import RuntimeConfig


def tokens(vocab: int, n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, n)


def prefill_vs_transformers(benchmark, model_dir, who: str, n: int, kv_tokens: int, medians: dict) -> None:
    if who == "graphcp":
        eng = PrefillEngine(model_dir, RuntimeConfig(kv_tokens=kv_tokens, moe="tp"))
        toks = tokens(eng.cfg.vocab_size, n)

        def run():
            out = eng.prefill([Request(toks)])
            eng.release(out.handles[0])
    else:
        transformers = pytest.importorskip("transformers")
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ids = torch.from_numpy(tokens(model.config.vocab_size, n)).view(1, -1)

        def run():
            with torch.inference_mode():
                model(input_ids=ids, logits_to_keep=1)
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    medians[who] = benchmark.stats.stats.median
    if who == "transformers" and "graphcp" in medians:
        benchmark.extra_info["graphcp_over_transformers_medians"] = medians["graphcp"] / medians["transformers"]
