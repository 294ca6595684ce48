"""DSA models (the `default-dsa` preset: DeepSeek V3.2, MoE past layer 0, index_topk 256)
on the CPU: eager prefill against transformers, and the indexer's work per rank.

Run: ``python -m pytest benchmarks/bench_dsa.py --benchmark-only -q``

(a) ``test_dsa_prefill_vs_transformers``: one 2048-token request, graphcp's eager
    prefill (CP 1) and transformers' forward (``logits_to_keep=1``) side by side;
    the transformers case stores ``graphcp_over_transformers_medians``.
(b) ``test_indexer_share_at_cp4``: one 2048-token request at CP 4 (interleave), the
    whole launch timed (fork + load + prefill); ``extra_info`` holds each rank's
    scored (query row, key token) pairs as a share of a replicated indexer's: the
    measured figure behind "about 1/C of the indexer a rank", counted, not timed.
"""

from __future__ import annotations

import numpy as np
import pytest
from vs_transformers import prefill_vs_transformers, tokens

from graphcp import PrefillEngine, Request
from graphcp.config import RuntimeConfig
from graphcp.dist import launch
from graphcp.model.dsa.sparse import STAT_PAIRS, STAT_REPLICATED
from graphcp.model.presets import ensure_preset

TOKENS = 2048
KV_TOKENS = 4096
_medians: dict[str, float] = {}


@pytest.fixture(scope="module")
def model_dir():
    return ensure_preset("default-dsa")


def _tokens(vocab: int) -> np.ndarray:
    return tokens(vocab, TOKENS)


@pytest.mark.benchmark(group="dsa-prefill")
@pytest.mark.parametrize("who", ["graphcp", "transformers"])
def test_dsa_prefill_vs_transformers(benchmark, model_dir, who):
    prefill_vs_transformers(benchmark, model_dir, who, TOKENS, KV_TOKENS, _medians)


def _rank_job(group, model_dir):
    eng = PrefillEngine(model_dir, RuntimeConfig(kv_tokens=KV_TOKENS, layout="interleave", moe="tp"), group)
    return dict(eng.prefill([Request(_tokens(eng.cfg.vocab_size))]).info.stats)


@pytest.mark.benchmark(group="dsa-indexer")
def test_indexer_share_at_cp4(benchmark, model_dir):
    stats = benchmark.pedantic(launch, args=(_rank_job, 4, model_dir), rounds=1, warmup_rounds=0)
    shares = [s[STAT_PAIRS] / s[STAT_REPLICATED] for s in stats]
    benchmark.extra_info.update(replicated_pairs=stats[0][STAT_REPLICATED],
                                pairs_per_rank=[s[STAT_PAIRS] for s in stats],
                                share_per_rank=shares)
    assert sum(s[STAT_PAIRS] for s in stats) == stats[0][STAT_REPLICATED]
