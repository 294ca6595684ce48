"""LayerSplit's cost on a chunked prefill: a request extending a long cached prefix.

Run: ``pytest benchmarks/bench_layer_split.py --benchmark-only``.

At CP 2 on the default model (4 layers), a 256-token chunk extends a 2048-token
cached prefix, eagerly, with the replicated and the layer-split cache. Inside the
ranks each forward is timed (median of ``REPEATS``); what the benchmark itself times
is the whole launch. ``extra_info`` holds the per-forward medians, the pool bytes of
each cache, the time of one layer's prefix fetch alone, and the bytes it broadcasts per layer (the live batch's
prefix pages) against what a static-shaped broadcast captured in a graph segment
would have to move per layer (every page a batch could read: the whole pool layer).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from graphcp import PrefillEngine, Request, RuntimeConfig
from graphcp.dist import launch

PREFIX, CHUNK, REPEATS = 2048, 256, 5


def _time_chunks(group, mode):
    eng = PrefillEngine("default", RuntimeConfig(kv_tokens=8192, kv_cache=mode), group)
    rng = np.random.default_rng(0)
    prefix = eng.prefill([Request(rng.integers(0, eng.cfg.vocab_size, PREFIX))]).handles[0]
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        out = eng.prefill([Request(rng.integers(0, eng.cfg.vocab_size, CHUNK), prefix)])
        times.append(time.perf_counter() - t0)
        prefix = out.handles[0]
        # the next chunk extends the same prefix again: drop the new tokens (a fresh request)
        eng.release(prefix)
        prefix = eng.prefill([Request(rng.integers(0, eng.cfg.vocab_size, PREFIX))]).handles[0]
    kv = eng.parts.kv
    page_bytes = kv.pool[0, 0].numel() * kv.pool.element_size()
    fetch = []
    fetches = kv.prefix_pages([prefix]) is not None  # a cache that keeps only some layers
    if fetches:  # the attention break's broadcast of one layer's prefix pages, alone
        pages = torch.tensor(prefix.pages, dtype=torch.long)
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            kv.fetch_prefix(eng.cfg.num_layers - 1, pages, group)
            fetch.append(time.perf_counter() - t0)
    return {"median_s": float(np.median(times)), "pool_bytes": kv.pool_bytes,
            "fetch_s_per_layer": float(np.median(fetch)) if fetch else 0.0,
            "fetch_bytes_per_layer": len(prefix.pages) * page_bytes if fetches else 0,
            "static_bytes_per_layer": kv.num_pages * page_bytes}


def test_chunk_after_a_cached_prefix(benchmark):
    res = {}

    def run():
        torch.set_num_threads(1)
        for mode in ("replicated", "layer-split"):
            res[mode] = launch(_time_chunks, 2, mode)[0]

    benchmark.pedantic(run, rounds=1, iterations=1)
    for mode, r in res.items():
        benchmark.extra_info[mode] = r
    benchmark.extra_info["layer_split_over_replicated"] = res["layer-split"]["median_s"] / res["replicated"]["median_s"]
