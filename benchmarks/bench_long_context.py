"""One long prompt's wall time and peak memory a rank: the torch reference at long context.

Run: ``python -m pytest benchmarks/bench_long_context.py --benchmark-only -q -s``
(``-s`` prints the table; ``--benchmark-json out.json`` keeps it in ``extra_info``).
Bigger prompts: ``GRAPHCP_LONG_CONTEXT=8192,32768,65536`` (the default, 8192, runs in
about 2.5 minutes on a busy 2-core VM; 64K at CP 2, both caches, took 4.5 minutes on a
quiet one and 32K 7 minutes on a busy one);
``GRAPHCP_LONG_CONTEXT_CP=2`` runs one CP degree only.

One request of N tokens (no prefix), prefilled eagerly on the torch reference backend
at CP 2 and 4, with the replicated and the token-sharded cache (its rings), on the
default model's shape (8 heads, 2 KV heads, head_dim 64, 4 layers, float32) with a
context of 128K (``default-128k``: the default preset with ``max_position_embeddings``
131072, seeded random weights). Each rank (a forked process, one thread) reports the
prefill's wall time and its peak resident memory: the kernel's high-water mark (VmHWM)
reset just before the prefill (``/proc/self/clear_refs``), so it is the peak during the
prefill (model, pool and every temporary), and the RSS just before it. A zigzag rank's
late block attends its rows after every earlier key (a bottom-right causal mask): what
the reference used to materialise as rows x keys (docs/performance.md).
"""

from __future__ import annotations

import os
import resource
import time

import numpy as np
import torch

from graphcp import ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch
from graphcp.model.presets import PRESETS, ensure_random_model

SIZES = tuple(int(n) for n in os.environ.get("GRAPHCP_LONG_CONTEXT", "8192").split(","))
CPS = tuple(int(c) for c in os.environ.get("GRAPHCP_LONG_CONTEXT_CP", "2,4").split(","))
CACHES = ("replicated", "sharded")
CONTEXT = 131072


def _rss_kib(field: str) -> int:
    """A ``/proc/self/status`` figure in KiB (VmRSS, VmHWM); 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_peak() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _prefill(group, folder: str, tokens: int, cache: str) -> dict:
    eng = PrefillEngine(folder, RuntimeConfig(kv_tokens=tokens + 256, kv_cache=cache, graph="off",
                                              attention="torch"), group, parallel=ParallelConfig(cp_size=group.size))
    ids = np.random.default_rng(0).integers(0, eng.cfg.vocab_size, tokens)
    before = _rss_kib("VmRSS")
    reset = _reset_peak()
    t0 = time.perf_counter()
    out = eng.prefill([Request(ids)])
    wall = time.perf_counter() - t0
    peak = _rss_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert torch.isfinite(out.last_logits).all()
    return {"wall_s": wall, "rss_before_mib": before / 1024, "peak_mib": peak / 1024}


def test_long_prompt_wall_and_peak_memory(benchmark):
    folder = str(ensure_random_model("default-128k", {**PRESETS["default"], "max_position_embeddings": CONTEXT}))
    rows = {}

    def run():
        for tokens in SIZES:
            for cp in CPS:
                for cache in CACHES:
                    ranks = launch(_prefill, cp, folder, tokens, cache, timeout_s=3600)
                    rows[f"{tokens}-cp{cp}-{cache}"] = {
                        "wall_s": max(r["wall_s"] for r in ranks),
                        "peak_mib": max(r["peak_mib"] for r in ranks),
                        "rss_before_mib": max(r["rss_before_mib"] for r in ranks),
                    }

    benchmark.pedantic(run, rounds=1, iterations=1)
    print("\ntokens-cp-cache: wall s, peak RSS a rank MiB (RSS before the prefill)")
    for key, r in rows.items():
        benchmark.extra_info[key] = r
        print(f"{key}: {r['wall_s']:.1f} s, {r['peak_mib']:.0f} MiB ({r['rss_before_mib']:.0f})")
