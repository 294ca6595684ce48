"""graphcp (CP 1) against transformers on the same checkpoint, the comparisons the
benchmarks share:

- one request's eager prefill against transformers' forward (``logits_to_keep=1``):
  bench_dsa.py, bench_dsv4.py (the transformers case stores
  ``graphcp_over_transformers_medians`` when the graphcp case ran first);
- an eager decode step of B requests of n cached tokens against transformers' own cached
  decode (its ``DynamicCache``, one token a request, the greedy next token to the host):
  bench_decode.py, at 1 x 512, 8 x 1,024 and 32 x 256;
- :func:`paired_ratio`: the median over rounds of t(graphcp) / t(transformers), the two
  run back to back in alternating order (a load swing on a shared machine hits both
  halves of a pair, far steadier than two medians taken apart): bench_engine.py too."""

from __future__ import annotations

import time
from collections.abc import Callable

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


def paired_ratio(graphcp_fn: Callable[[], object], hf_fn: Callable[[], object], rounds: int,
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """Median over ``rounds`` of t(graphcp) / t(transformers), run back to back, the order
    alternating (see the module doc); ``clock``: wall time, or ``time.process_time`` (the
    CPU time the process spent: what the work costs, not what the machine's load adds)."""
    ratios = []
    for i in range(rounds):
        t = {}
        for name, f in (("g", graphcp_fn), ("h", hf_fn)) if i % 2 == 0 else (("h", hf_fn), ("g", graphcp_fn)):
            t0 = clock()
            f()
            t[name] = clock() - t0
        ratios.append(t["g"] / t["h"])
    return float(np.median(ratios))


class DecodeSteps:
    """B requests of n tokens prefilled in graphcp (eager, CP 1, float32) and in
    transformers from the same tokens; :meth:`graphcp` and :meth:`transformers` each run
    one decode step of every request (greedy: the next tokens reach the host as ids) and
    return them. Each step grows both caches by one token, the same for both."""

    def __init__(self, model_dir, requests: int, context: int, page_size: int = 16) -> None:
        transformers = pytest.importorskip("transformers")
        self.engine = PrefillEngine(model_dir, RuntimeConfig(kv_tokens=requests * (context + 256) + 1024,
                                                             graph="off", page_size=page_size))
        vocab = self.engine.cfg.vocab_size
        prompts = np.random.default_rng(1).integers(0, vocab, (requests, context))
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.inference_mode():
            out = self.model(input_ids=torch.from_numpy(prompts), use_cache=True, logits_to_keep=1)
        self._cache, self._hf_next = out.past_key_values, out.logits[:, -1].argmax(-1).view(-1, 1)
        first = self.engine.prefill([Request(p) for p in prompts])
        self._handles = first.handles
        self._next = first.last_logits.argmax(-1).numpy()

    def graphcp(self) -> np.ndarray:
        out = self.engine.decode(self._handles, self._next)
        self._handles, self._next = out.handles, out.tokens
        return out.tokens

    def transformers(self) -> np.ndarray:
        with torch.inference_mode():
            out = self.model(input_ids=self._hf_next, past_key_values=self._cache, use_cache=True)
        self._cache, self._hf_next = out.past_key_values, out.logits[:, -1].argmax(-1).view(-1, 1)
        return self._hf_next.view(-1).tolist()
