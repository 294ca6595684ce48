"""The EAGLE-3 draft checkpoint (graphcp.model.eagle3): a tiny checkpoint in the public
format loads (its layer ids from eagle_config, SGLang's default without it); a
missing, unexpected or mis-shaped tensor, a bad vocabulary map and a config that does
not fit the target are one-line errors."""

from __future__ import annotations

import pytest
import torch
from eagle3_ref import LAYER_IDS, draft_config, draft_tensors, write_draft, write_target

from graphcp import ConfigError
from graphcp.model.config import ModelConfig
from graphcp.model.eagle3.checkpoint import load_draft
from graphcp.model.eagle3.config import default_layer_ids
from graphcp.model.loader import CheckpointError


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = write_target(tmp_path_factory.mktemp("e3target"))
    return ModelConfig.from_file(folder / "config.json")


def _load(folder, target):
    embed = torch.nn.Embedding(target.vocab_size, target.hidden_size)
    return load_draft(folder, target, embed, torch.float32, "cpu", 4096)


def test_a_tiny_public_checkpoint_loads(tmp_path, target):
    t = draft_tensors()
    draft = _load(write_draft(tmp_path / "d", t), target)
    assert draft.aux_layer_ids == LAYER_IDS and draft.cfg.ids_from == "checkpoint"
    assert draft.layer_index == target.num_layers  # its K/V: the cache layer after the target's
    q, kv = 64, 32
    w = draft.self_attn.qkv.weight
    assert torch.equal(w[:q], t["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(w[q + kv:], t["midlayer.self_attn.v_proj.weight"])
    assert torch.equal(draft.mlp.gate_up.weight[96:], t["midlayer.mlp.up_proj.weight"])
    assert torch.equal(draft.hidden_norm.weight, t["midlayer.hidden_norm.weight"])
    assert torch.equal(draft.draft_to_target, torch.arange(128) + t["d2t"])
    # SGLang's default without eagle_config: outputs of layers 1, L // 2 - 1, L - 4; a "model." prefix is read too
    prefixed = {("model." + k if k.startswith("midlayer") else k): v for k, v in t.items()}
    d = _load(write_draft(tmp_path / "default", prefixed, draft_config(eagle_config=None)), target)
    assert d.aux_layer_ids == default_layer_ids(4) == (1, 1, 0) and d.cfg.ids_from == "default"


def _broken(name):
    t = draft_tensors()
    if name == "missing":
        del t["midlayer.self_attn.k_proj.weight"]
    elif name == "shape":
        t["fc.weight"] = t["fc.weight"][:, :100]
    elif name == "unexpected":
        t["midlayer.self_attn.q_norm.weight"] = torch.ones(16)
    elif name == "d2t-dtype":
        t["d2t"] = t["d2t"].float()
    elif name == "d2t-range":
        t["d2t"][-1] = 10_000
    elif name == "t2d":
        t["t2d"][t["t2d"].nonzero()[0]] = False
    return t


@pytest.mark.parametrize("name, message", [
    ("missing", r"missing tensor 'midlayer.self_attn.k_proj.weight' of the EAGLE-3 draft \(1 missing in all\)"),
    ("shape", r"tensor 'fc.weight' has shape \[64, 100\], expected \[64, 192\]"),
    ("unexpected", r"unexpected tensor 'midlayer.self_attn.q_norm.weight'"),
    ("d2t-dtype", r"tensor 'd2t' has dtype torch.float32, expected an integer tensor"),
    ("d2t-range", r"d2t maps draft id 127 to target id"),
    ("t2d", r"d2t and t2d disagree"),
])
def test_a_broken_checkpoint_is_a_one_line_error(tmp_path, target, name, message):
    with pytest.raises(CheckpointError, match=message) as e:
        _load(write_draft(tmp_path / name, _broken(name)), target)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    ({"architectures": ["LlamaForCausalLM"]}, r"architectures must be \['LlamaForCausalLMEagle3'\]"),
    ({"num_key_value_heads": 4}, r"num_key_value_heads=4, the target model has 2"),
    ({"num_hidden_layers": 2}, r"num_hidden_layers=2; graphcp runs EAGLE-3 drafts of one layer"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 4]}},
     r"eagle_aux_hidden_state_layer_ids\[2\] \(a target decoder layer\) must be .*got 4"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]}}, r"must list 3 target layers"),
    ({"target_hidden_size": 128}, r"target_hidden_size=128, the target model has hidden_size=64"),
    ({"attention_bias": True}, r"attention_bias=true is not an EAGLE-3 draft graphcp runs"),
])
def test_a_config_that_does_not_fit_is_a_one_line_error(tmp_path, target, overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        _load(write_draft(tmp_path / "c", config=draft_config(**overrides)), target)
    assert "\n" not in str(e.value)
