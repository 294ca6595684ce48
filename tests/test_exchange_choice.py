"""The per-batch exchange rule at its boundaries, its options and their checks."""

from __future__ import annotations

import math

import pytest
import torch

from graphcp.attention.ring.exchange_choice import choose_exchange, hide_threshold, miss_threshold
from graphcp.attention.ring.hardware import HardwareSpec, measure_link_gb_per_s, measure_peak_tflops
from graphcp.cli.main import build_parser
from graphcp.config import RuntimeConfig
from graphcp.dist import CPGroup
from graphcp.errors import ConfigError
from graphcp.jobs.preflight import job_spec

H100 = HardwareSpec()
GQA3 = dict(num_heads=24, num_kv_heads=8, head_dim=128)  # N_H / N_KV = 3


def _choose(new, cached, requested="auto", cp=4, elem=2, hw=H100, **model):
    return choose_exchange(requested, new, cached, cp_size=cp, elem_bytes=elem, hw=hw, **(model or GQA3))


def test_hide_threshold_is_the_published_formula():
    # T >= C F N_KV e / (2 N_H BW): at C = 4, bf16, H100 figures, N_H / N_KV = 3
    want = 4 * 989e12 * 8 * 2 / (2 * 24 * 450e9)
    assert hide_threshold(4, 24, 8, 2, H100) == pytest.approx(want)
    assert 2900 < want < 2950


def test_pass_kv_from_the_hide_threshold_on():
    t = math.ceil(hide_threshold(4, 24, 8, 2, H100))
    cached = 100 * t  # a miss rate far below the other condition's threshold
    at, below = _choose(t, cached), _choose(t - 1, cached)
    assert (at.exchange, at.reason) == ("pass-kv", "hides")
    assert (below.exchange, below.reason) == ("pass-q", "pass-q")


def test_pass_kv_from_the_miss_rate_threshold_on():
    need = miss_threshold(24, 8, 128, 2)
    # both rings' bytes: (T + P) 2 N_KV D e against T N_H (D e) ring + T N_H (D e + 4) all-to-all
    assert need == pytest.approx(2 * 8 * 256 / (24 * (2 * 256 + 4)))
    new = 100  # far below the hide threshold
    cached_at = math.floor(new / need - new)  # miss rate just above the threshold
    assert new / (new + cached_at) >= need > new / (new + cached_at + 1)
    assert _choose(new, cached_at).reason == "cheaper"
    assert _choose(new, cached_at + 1).exchange == "pass-q"


def test_the_rule_follows_the_hardware_and_the_heads():
    slow_link = HardwareSpec(peak_tflops=989.0, link_gb_per_s=45.0)  # 10x the hide threshold
    assert _choose(4096, 40960).exchange == "pass-kv"
    assert _choose(4096, 40960, hw=slow_link).exchange == "pass-q"
    mha = dict(num_heads=8, num_kv_heads=8, head_dim=64)  # the KV as large as pass-Q's queries and partials
    assert _choose(500, 0, **mha).reason == "cheaper"
    assert _choose(500, 10, **mha).exchange == "pass-q"
    assert _choose(10000, 10, **mha).reason == "hides"  # its threshold: 8790 tokens


def test_forced_exchanges_are_kept_and_reported_with_their_inputs():
    c = _choose(64, 4096, requested="pass-kv")
    assert (c.exchange, c.reason) == ("pass-kv", "forced")
    d = c.as_dict()
    assert d["new_tokens"] == 64 and d["cached_tokens"] == 4096 and d["miss_rate"] == pytest.approx(64 / 4160)
    assert _choose(4096, 0, requested="pass-q").exchange == "pass-q"


def test_acceptance_cases_with_default_constants():
    """C = 4, N_H / N_KV = 3: a fresh 4K prompt runs pass-KV, a 64-token extend of a 4K
    cached prefix pass-Q (in bf16 and float32 elements alike)."""
    for elem in (2, 4):
        assert _choose(4096, 0, elem=elem).exchange == "pass-kv"
        assert _choose(64, 4096, elem=elem).exchange == "pass-q"


def test_options_and_their_checks():
    # the pairs the sharded cache refuses: tests/test_combinations.py, from graphcp/combinations.py
    with pytest.raises(ConfigError, match="RuntimeConfig.kv_cache must be one of replicated, sharded"):
        RuntimeConfig(kv_cache="ring")
    with pytest.raises(ConfigError, match="link_gb_per_s must be > 0"):
        RuntimeConfig(link_gb_per_s=0.0)
    with pytest.raises(ConfigError, match="peak_tflops"):
        HardwareSpec(peak_tflops=float("nan"))
    args = build_parser().parse_args(["prefill", "--input", "x", "--output", "y", "--kv-cache", "sharded",
                                      "--exchange", "pass-q", "--peak-tflops", "500", "--link-gb-per-s", "50"])
    rt = job_spec(args).runtime
    assert (rt.kv_cache, rt.exchange, rt.peak_tflops, rt.link_gb_per_s) == ("sharded", "pass-q", 500.0, 50.0)


def test_the_measuring_helpers_run_anywhere():
    assert measure_peak_tflops("cpu", torch.float32, n=64, repeats=1) > 0
    assert measure_link_gb_per_s(CPGroup()) == 0.0  # one rank: no link (two ranks: tests/test_sharded_graphs.py)
