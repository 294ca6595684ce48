"""RoPE scaling against transformers: YaRN and linear on Llama and Qwen3 checkpoints,
both spellings (transformers 5's ``rope_parameters``, 4.x's ``rope_scaling`` +
``rope_theta``), prompts longer than ``original_max_position_embeddings``, float32
and bfloat16; the frequency tables bitwise against transformers' own functions; and
every RoPE graphcp does not implement refused with a message naming it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_hf_model
from helpers import rel_err

from graphcp import PrefillEngine, Request
from graphcp.config import RuntimeConfig
from graphcp.errors import ConfigError
from graphcp.model.config import ModelConfig
from graphcp.model.layers import Rotary
from graphcp.model.rope import RopeConfig

#: the acceptance bound in float32; bfloat16 as the other bf16 parity tests
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
ORIG = 128  # original_max_position_embeddings: every long prompt below runs past it
LENS = [700, 1, 260, 129]
SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
    # DeepSeek-style attention factor (mscale / mscale_all_dim) and non-default betas
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIG, "beta_fast": 16.0,
                    "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5},
    "linear": {"rope_type": "linear", "factor": 4.0},
}
THETA = {"llama": 10000.0, "qwen3": 1000000.0}


def _write(folder: Path, family: str, scaling: str, spelling: str) -> Path:
    """A tiny checkpoint whose config.json spells the RoPE one way or the other."""
    rope = dict(SCALINGS[scaling])
    model = build_hf_model(family, False, "float32", seed=3, max_position_embeddings=1024,
                           rope_parameters={**rope, "rope_theta": THETA[family]}, rope_scaling=None)
    model.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == rope["rope_type"], cfg["rope_parameters"]
    if spelling == "rope_scaling":  # the transformers 4.x layout
        cfg.pop("rope_parameters")
        cfg["rope_scaling"] = {("type" if scaling == "linear" else "rope_type"): rope.pop("rope_type"), **rope}
        cfg["rope_theta"] = THETA[family]
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache: dict = {}

    def get(family: str, scaling: str, spelling: str) -> Path:
        key = (family, scaling, spelling)
        if key not in cache:
            cache[key] = _write(tmp_path_factory.mktemp(f"{family}-{scaling}-{spelling}"), family, scaling, spelling)
        return cache[key]

    return get


def _tokens(vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(0, vocab, n)) for n in LENS]


@torch.inference_mode()
def _hf(folder: Path, dtype: str, toks):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    rope = model.config.rope_parameters
    return [model(input_ids=t.view(1, -1)).logits[0].float() for t in toks], rope


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_scaled_rope_matches_transformers(family, scaling, spelling, dtype, checkpoint):
    if dtype == "bfloat16" and (spelling == "rope_scaling" or scaling == "yarn-mscale"):
        pytest.skip("bfloat16 runs once per family and RoPE type (the spelling is dtype-independent)")
    folder = checkpoint(family, scaling, spelling)
    engine = PrefillEngine(folder, RuntimeConfig(dtype=dtype, kv_tokens=2048))
    assert engine.cfg.rope.rope_type == SCALINGS[scaling]["rope_type"]
    toks = _tokens(engine.cfg.vocab_size, seed=len(scaling))
    ref, hf_rope = _hf(folder, dtype, toks)
    assert hf_rope["rope_type"] == SCALINGS[scaling]["rope_type"] and hf_rope["rope_theta"] == THETA[family]
    out = engine.prefill([Request(t) for t in toks], all_logits=True)
    for j, (got, want) in enumerate(zip(out.logits, ref)):
        err = rel_err(got, want)
        assert err < TOL[dtype], f"request {j} ({len(toks[j])} tokens): relative error {err:.3g} > {TOL[dtype]}"
    # not vacuous: the scaled tables differ from unscaled ones past the original context
    plain = Rotary(engine.cfg.head_dim, 1024, RopeConfig(theta=THETA[family]))
    assert not torch.allclose(engine.parts.model.rotary.cos[ORIG:], plain.cos[ORIG:], atol=1e-3)


def test_both_spellings_give_the_same_model(checkpoint):
    """rope_parameters and rope_scaling + rope_theta read to the same RopeConfig and logits."""
    for family in ("llama", "qwen3"):
        for scaling in SCALINGS:
            a = ModelConfig.from_file(checkpoint(family, scaling, "rope_parameters") / "config.json").rope
            b = ModelConfig.from_file(checkpoint(family, scaling, "rope_scaling") / "config.json").rope
            assert a == b, (family, scaling)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "truncate": False},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024, "beta_fast": 16, "beta_slow": 2},
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
         "mscale_all_dim": 0.8},
        {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 100, "mscale": 2.0},  # mscale alone
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 0.9},
        {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 8192},
        {"rope_type": "linear", "factor": 3.5},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 512},
        {"rope_type": "default"},
    ],
)
@pytest.mark.parametrize("theta", [10000.0, 1000000.0])
def test_tables_equal_transformers_bitwise(params, theta):
    """inv_freq, the attention factor and the cos/sin tables, against transformers'
    rotary embedding built from the same config (float32, bitwise)."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    d = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, num_attention_heads=2,
             num_hidden_layers=1, intermediate_size=64, vocab_size=64, max_position_embeddings=8192,
             rope_parameters={**params, "rope_theta": theta})
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in json.loads(json.dumps(d)).items()
                                          if k not in ("architectures", "model_type")})
    hf = LlamaRotaryEmbedding(hf_cfg)
    ours = ModelConfig.from_hf_dict(json.loads(json.dumps(d)))
    rot = Rotary(ours.head_dim, 4096, ours.rope)
    assert torch.equal(ours.rope.inv_freq(ours.head_dim), hf.inv_freq)
    assert ours.rope.attention_factor == hf.attention_scaling
    pos = torch.arange(4096).view(1, -1)
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), pos)
    assert torch.equal(rot.cos, cos[0]) and torch.equal(rot.sin, sin[0])


# ---- refused ---------------------------------------------------------------------------
BASE = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
            intermediate_size=128, vocab_size=64, max_position_embeddings=4096)


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope_type 'dynamic' \(dynamic NTK\) is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, r"'dynamic'"),
        ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
         r"rope_type 'longrope' is not supported"),
        ({"rope_parameters": {"rope_type": "ntk-by-parts-v9", "factor": 2.0}}, r"'ntk-by-parts-v9' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                              "beta_fastest": 3}}, r"key 'beta_fastest' is not understood for rope_type 'yarn'"),
        ({"rope_parameters": {"rope_type": "default", "factor": 2.0}}, r"key 'factor' is not understood"),
        ({"rope_parameters": {"rope_type": "linear"}}, r"'linear' needs a factor"),
        ({"rope_parameters": {"rope_type": "linear", "factor": float("nan")}}, r"factor must be a finite number"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64}},
         r"factor must be >= 1.0, got 0.5"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                              "beta_fast": 1, "beta_slow": 8}}, r"beta_fast=1.0 must be >= beta_slow=8.0"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                              "truncate": "yes"}}, r"truncate must be true or false"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}},
         r"'llama3' needs low_freq_factor"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
         r"partial_rotary_factor=0.5 .* is not supported"),
        ({"partial_rotary_factor": 0.25}, r"partial_rotary_factor=0.25"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, r"per-layer-type entries"),
        ({"rope_parameters": "default"}, r"rope_parameters must be an object"),
        ({"rope_scaling": ["yarn", 2]}, r"rope_scaling must be an object"),
        ({"rope_theta": 0.5}, r"rope_theta must be > 1"),
        # issue 13, case 6: transformers would apply rope_scaling's YaRN and drop rope_parameters
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
          "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
         r"rope_scaling and rope_parameters disagree \(.*rope_type: 'yarn' vs 'default'"),
    ],
)
def test_unsupported_rope_is_refused_by_name(extra, match):
    with pytest.raises(ConfigError, match=match) as e:
        ModelConfig.from_hf_dict(json.loads(json.dumps({**BASE, **extra})), source="m/config.json")
    assert str(e.value).startswith("m/config.json: "), str(e.value)


def test_agreeing_spellings_are_accepted():
    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    a = ModelConfig.from_hf_dict({**BASE, "rope_parameters": dict(rope), "rope_scaling": dict(rope)}).rope
    b = ModelConfig.from_hf_dict({**BASE, "rope_parameters": dict(rope)}).rope
    assert a == b and a.rope_type == "yarn" and a.factor == 2.0
    # a top-level original_max_position_embeddings wins, as in transformers (Phi-3's layout)
    c = ModelConfig.from_hf_dict({**BASE, "rope_parameters": dict(rope), "original_max_position_embeddings": 32}).rope
    assert c.original_max_position_embeddings == 32
