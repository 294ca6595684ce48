"""DeepSeek V4 (the `default-v4` preset: sliding, CSA, HCA, CSA layers, mHC of 4
streams, 16 experts) on the CPU: eager prefill against transformers, and the work and
bytes per rank under CP.

Run: ``python -m pytest benchmarks/bench_dsv4.py --benchmark-only -q``

(a) ``test_dsv4_prefill_vs_transformers``: one 2048-token request, graphcp's eager
    prefill (CP 1) and transformers' forward (``logits_to_keep=1``) side by side;
    the transformers case stores ``graphcp_over_transformers_medians``.
(b) ``test_dsv4_work_at_cp4``: one 2048-token request at CP 4 (zigzag), the whole
    launch timed (fork + load + prefill); ``extra_info`` holds each rank's share of the
    indexer's scored pairs and of attention's (row, key) pairs (counted, not timed) and
    the bytes a rank received in the exchange.
"""

from __future__ import annotations

import numpy as np
import pytest
from vs_transformers import prefill_vs_transformers, tokens

from graphcp import PrefillEngine, Request
from graphcp.config import RuntimeConfig
from graphcp.dist import launch
from graphcp.model.dsv4.sparse import REPLICATED, STAT_ATTN_PAIRS, STAT_INDEX_PAIRS
from graphcp.model.forward_context import KV_RECEIVED
from graphcp.model.presets import ensure_preset

TOKENS = 2048
KV_TOKENS = 4096
_medians: dict[str, float] = {}


@pytest.fixture(scope="module")
def model_dir():
    return ensure_preset("default-v4")


def _tokens(vocab: int) -> np.ndarray:
    return tokens(vocab, TOKENS)


@pytest.mark.benchmark(group="dsv4-prefill")
@pytest.mark.parametrize("who", ["graphcp", "transformers"])
def test_dsv4_prefill_vs_transformers(benchmark, model_dir, who):
    prefill_vs_transformers(benchmark, model_dir, who, TOKENS, KV_TOKENS, _medians)


def _rank_job(group, model_dir):
    eng = PrefillEngine(model_dir, RuntimeConfig(kv_tokens=KV_TOKENS, moe="tp"), group)
    return dict(eng.prefill([Request(_tokens(eng.cfg.vocab_size))]).info.stats)


@pytest.mark.benchmark(group="dsv4-work")
def test_dsv4_work_at_cp4(benchmark, model_dir):
    stats = benchmark.pedantic(launch, args=(_rank_job, 4, model_dir), rounds=1, warmup_rounds=0)
    for key in (STAT_INDEX_PAIRS, STAT_ATTN_PAIRS):
        rep = stats[0][key + REPLICATED]
        benchmark.extra_info[key + "_share_per_rank"] = [s[key] / rep for s in stats]
        assert sum(s[key] for s in stats) == rep
    benchmark.extra_info["exchange_bytes_received_per_rank"] = [s[KV_RECEIVED] for s in stats]
