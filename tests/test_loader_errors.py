"""The HF checkpoint loader: what it rejects (and that the message says where),
sharded checkpoints, and TP sharding of the MLP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import copy_model, rel_err
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from graphcp import PrefillEngine, Request
from graphcp.config import RuntimeConfig
from graphcp.errors import ConfigError
from graphcp.model.loader import CheckpointError, load_model

F32 = torch.float32
# the tiny llama's tensors: attention + MLP biases, untied lm_head
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
V_PROJ = "model.layers.1.self_attn.v_proj.weight"


@pytest.fixture(scope="module")
def llama_dir(hf_model_dir) -> Path:
    return hf_model_dir("llama", False, "float32")


def _edit(folder: Path, fn) -> None:
    """Rewrite model.safetensors through ``fn(dict of tensors)``."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


def test_loads_and_maps_every_tensor(llama_dir):
    """Sanity for the error tests below: the untouched folder loads, every HF tensor
    lands in its slice of the fused parameters."""
    cfg, model = load_model(llama_dir, F32)
    hf = _hf_tensors(llama_dir)
    qs, kvs = cfg.q_size, cfg.kv_size
    attn = model.layers[1].self_attn
    torch.testing.assert_close(attn.qkv.weight[:qs], hf["model.layers.1.self_attn.q_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(attn.qkv.weight[qs + kvs:], hf[V_PROJ], rtol=0, atol=0)
    torch.testing.assert_close(attn.qkv.bias[qs: qs + kvs], hf["model.layers.1.self_attn.k_proj.bias"], rtol=0, atol=0)
    torch.testing.assert_close(attn.o_proj.bias, hf["model.layers.1.self_attn.o_proj.bias"], rtol=0, atol=0)
    torch.testing.assert_close(model.layers[1].mlp.down_bias, hf["model.layers.1.mlp.down_proj.bias"], rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.weight, hf["lm_head.weight"], rtol=0, atol=0)


# ---- config ------------------------------------------------------------------------------
def test_unsupported_architecture_names_file_and_entry(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path / "m")
    _edit_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConfigError) as e:
        load_model(d, F32)
    msg = str(e.value)
    assert str(d / "config.json") in msg and "'GPT2LMHeadModel'" in msg
    # the engine (and so the CLI) surfaces the same error
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        PrefillEngine(d, RuntimeConfig(kv_tokens=256))


def test_sliding_window_mistral_is_rejected(hf_model_dir):
    d = hf_model_dir("mistral", False, "float32", sliding_window=256)
    assert json.loads((d / "config.json").read_text())["sliding_window"] == 256
    with pytest.raises(ConfigError, match=r"sliding_window=256"):
        load_model(d, F32)


def test_unsupported_rope_type_is_rejected(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling"))
    rope["rope_type"] = "longrope"  # yarn is implemented now (tests/test_rope_scaling.py)
    _edit_config(d, rope_parameters=rope, rope_scaling=rope)
    with pytest.raises(ConfigError, match="rope_type 'longrope' is not supported"):
        load_model(d, F32)


# ---- tensors -----------------------------------------------------------------------------
def test_missing_tensor_is_named(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path / "m")
    _edit(d, lambda t: t.pop(V_PROJ))
    with pytest.raises(CheckpointError, match=rf"missing tensor '{V_PROJ}'"):
        load_model(d, F32)


def test_missing_lm_head_of_untied_model_is_named(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path / "m")
    _edit(d, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head.weight'"):
        load_model(d, F32)


def test_unexpected_tensor_names_file_and_tensor(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path / "m")
    _edit(d, lambda t: t.update({"model.layers.0.self_attn.extra_proj.weight": torch.zeros(4, 4)}))
    with pytest.raises(CheckpointError) as e:
        load_model(d, F32)
    msg = str(e.value)
    assert "model.safetensors" in msg and "'model.layers.0.self_attn.extra_proj.weight'" in msg


def test_layer_beyond_num_layers_is_unexpected(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path / "m")
    _edit(d, lambda t: t.update({"model.layers.2.input_layernorm.weight": torch.ones(64)}))
    with pytest.raises(CheckpointError, match=r"'model.layers.2.input_layernorm.weight'"):
        load_model(d, F32)


def test_ignored_rotary_inv_freq_loads(llama_dir, tmp_path):
    """Older exports carry RoPE tables; they hold no weights and are skipped."""
    d = copy_model(llama_dir, tmp_path / "m")
    _edit(d, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_model(d, F32)


@pytest.mark.parametrize(
    "name,shape",
    [
        (Q_PROJ, (64, 32)),  # wrong input dim
        (Q_PROJ, (32, 64)),  # too few rows: fits inside the fused qkv, must not load silently
        (V_PROJ, (64, 64)),  # too many rows: runs past the end of the fused qkv
        ("model.layers.0.self_attn.k_proj.bias", (16,)),
        ("model.norm.weight", (32,)),
        ("model.embed_tokens.weight", (500, 64)),
        ("model.layers.1.mlp.gate_proj.weight", (96, 64)),
        ("model.layers.0.mlp.up_proj.weight", (256, 64)),  # too many rows: each TP shard would still fit
        ("model.layers.1.mlp.down_proj.weight", (64, 96)),
        ("model.layers.1.mlp.down_proj.bias", (64, 1)),
    ],
)
def test_shape_mismatch_names_tensor_and_both_shapes(llama_dir, tmp_path, name, shape):
    d = copy_model(llama_dir, tmp_path / "m")
    expected = []

    def edit(t):
        expected.extend(t[name].shape)
        t[name] = torch.randn(shape)

    _edit(d, edit)
    for tp, rank in ((1, 0), (2, 1)):
        with pytest.raises(CheckpointError) as e:
            load_model(d, F32, rank=rank, tp_size=tp)
        msg = str(e.value)
        assert f"'{name}'" in msg, msg
        assert str(list(shape)) in msg and str(expected) in msg, msg


def test_qk_norm_shape_mismatch_reports_head_dim(hf_model_dir, tmp_path):
    """q_norm is per head: the expected shape is [head_dim], not [hidden]."""
    d = copy_model(hf_model_dir("qwen3", True, "float32"), tmp_path / "m")
    name = "model.layers.1.self_attn.q_norm.weight"
    _edit(d, lambda t: t.update({name: torch.ones(64)}))
    with pytest.raises(CheckpointError) as e:
        load_model(d, F32)
    msg = str(e.value)
    assert f"'{name}'" in msg and "[64]" in msg and "expected [32]" in msg, msg


def test_dtype_mismatch_with_config_names_tensor(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path / "m")
    assert json.loads((d / "config.json").read_text()).get("dtype", "float32") == "float32"
    _edit(d, lambda t: t.update({Q_PROJ: t[Q_PROJ].half()}))
    with pytest.raises(CheckpointError) as e:
        load_model(d, F32)
    msg = str(e.value)
    assert f"'{Q_PROJ}'" in msg and "float16" in msg and "model.safetensors" in msg, msg


@pytest.mark.parametrize("int_dtype", [torch.int32, torch.int64])
def test_integer_tensor_names_tensor(llama_dir, tmp_path, int_dtype):
    d = copy_model(llama_dir, tmp_path / "m")
    name = "model.layers.0.input_layernorm.weight"
    _edit(d, lambda t: t.update({name: torch.ones(64, dtype=int_dtype)}))
    with pytest.raises(CheckpointError) as e:
        load_model(d, F32)
    msg = str(e.value)
    assert f"'{name}'" in msg and "float" in msg, msg


def test_no_weights_file(llama_dir, tmp_path):
    d = copy_model(llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(d, F32)


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path, F32)


# ---- sharded checkpoints ---------------------------------------------------------------
def test_sharded_checkpoint_loads_and_matches(hf_model_dir):
    single = hf_model_dir("qwen2", False, "float32")
    sharded = hf_model_dir("qwen2", False, "float32", shard_size="50KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and not (sharded / "model.safetensors").exists()
    _, a = load_model(single, F32)
    _, b = load_model(sharded, F32)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=0, msg=k)
    # and the engine runs it exactly like the single-file checkpoint
    toks = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0))
    la = PrefillEngine(single, RuntimeConfig(kv_tokens=256)).prefill([Request(toks)]).last_logits
    lb = PrefillEngine(sharded, RuntimeConfig(kv_tokens=256)).prefill([Request(toks)]).last_logits
    torch.testing.assert_close(lb, la, rtol=0, atol=0)


def test_sharded_index_naming_a_missing_shard(hf_model_dir, tmp_path):
    d = copy_model(hf_model_dir("qwen2", False, "float32", shard_size="50KB"), tmp_path / "m")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[-1]
    (d / gone).unlink()
    with pytest.raises(CheckpointError, match=gone):
        load_model(d, F32)


# ---- TP sharding -------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_ranks_load_only_their_mlp_shard(llama_dir, tp):
    cfg, full = load_model(llama_dir, F32)
    inter, hidden = cfg.intermediate_size, cfg.hidden_size
    shard = inter // tp
    ranks = [load_model(llama_dir, F32, rank=r, tp_size=tp)[1] for r in range(tp)]
    for i in range(cfg.num_layers):
        fm = full.layers[i].mlp
        gate_full, up_full = fm.gate_up.weight[:inter], fm.gate_up.weight[inter:]
        gb_full, ub_full = fm.gate_up.bias[:inter], fm.gate_up.bias[inter:]
        parts = [m.layers[i].mlp for m in ranks]
        for p in parts:
            assert p.gate_up.weight.shape == (2 * shard, hidden)
            assert p.gate_up.bias.shape == (2 * shard,)
            assert p.down.weight.shape == (hidden, shard)
        cat0 = lambda ts: torch.cat(ts, dim=0)  # noqa: E731
        torch.testing.assert_close(cat0([p.gate_up.weight[:shard] for p in parts]), gate_full, rtol=0, atol=0)
        torch.testing.assert_close(cat0([p.gate_up.weight[shard:] for p in parts]), up_full, rtol=0, atol=0)
        torch.testing.assert_close(cat0([p.gate_up.bias[:shard] for p in parts]), gb_full, rtol=0, atol=0)
        torch.testing.assert_close(cat0([p.gate_up.bias[shard:] for p in parts]), ub_full, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([p.down.weight for p in parts], dim=1), fm.down.weight, rtol=0, atol=0)
        # attention weights and the row-parallel down bias stay whole on every rank
        for p, m in zip(parts, ranks):
            torch.testing.assert_close(p.down_bias, fm.down_bias, rtol=0, atol=0)
            torch.testing.assert_close(m.layers[i].self_attn.qkv.weight, full.layers[i].self_attn.qkv.weight,
                                       rtol=0, atol=0)
    # the shards compute the full MLP: sum of the per-rank partial products
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1))
    fm, parts = full.layers[0].mlp, [m.layers[0].mlp for m in ranks]

    def partial(m):
        g, u = m.gate_up(x).split(m.shard, dim=-1)
        return m.down(torch.nn.functional.silu(g) * u)

    assert rel_err(sum(partial(p) for p in parts), partial(fm)) < 1e-5


def test_intermediate_not_divisible_by_tp(llama_dir):
    with pytest.raises(ConfigError, match=r"intermediate_size=128 does not divide by tp_size=cp_size=3"):
        load_model(llama_dir, F32, rank=0, tp_size=3)
