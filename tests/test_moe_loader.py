"""Loading MoE checkpoints in the Hub format (one tensor per expert per projection, as
transformers saves them): each rank reads only its experts (``ep``) or its shard of
every expert (``tp``); bad checkpoints are refused naming the tensor or the setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import copy_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from graphcp.cli.main import main
from graphcp.errors import ConfigError
from graphcp.model.loader import CheckpointError, load_model

F32 = torch.float32
E, I = 8, 32  # the conftest Qwen3-MoE: 8 experts of intermediate size 32; layer 1 dense


@pytest.fixture(scope="module")
def moe_dir(hf_model_dir) -> Path:
    return hf_model_dir("qwen3_moe")


def _edit(folder: Path, fn) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _expert(e: int, proj: str, layer: int = 0) -> str:
    return f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"


@pytest.mark.parametrize("moe", ["ep", "tp"])
def test_ranks_read_only_their_experts_or_shard(moe_dir, moe):
    with safe_open(str(moe_dir / "model.safetensors"), framework="pt") as f:
        hf = {k: f.get_tensor(k) for k in f.keys()}
    for rank in range(2):
        read: list[str] = []
        _, model = load_model(moe_dir, F32, rank=rank, tp_size=2, on_tensor=read.append, moe=moe)
        experts = {int(n.split(".")[5]) for n in read if ".experts." in n}
        assert experts == (set(range(rank * 4, rank * 4 + 4)) if moe == "ep" else set(range(E)))
        assert "model.layers.0.mlp.gate.weight" in read  # the router, whole on every rank
        ex = model.layers[0].mlp.experts
        for local in range(ex.num_local):
            e = rank * 4 + local if moe == "ep" else local
            rows = slice(None) if moe == "ep" else slice(rank * I // 2, (rank + 1) * I // 2)
            n = ex.intermediate
            assert torch.equal(ex.gate_up[local, :n], hf[_expert(e, "gate_proj")][rows])
            assert torch.equal(ex.gate_up[local, n:], hf[_expert(e, "up_proj")][rows])
            assert torch.equal(ex.down[local], hf[_expert(e, "down_proj")][:, rows])


@pytest.mark.parametrize("rank", [0, 1])
def test_missing_expert_tensor_is_named_on_every_rank(moe_dir, tmp_path, rank):
    d = copy_model(moe_dir, tmp_path / "m")
    _edit(d, lambda t: t.pop(_expert(5, "up_proj")))
    # rank 1 holds expert 5, rank 0 does not: both refuse the same checkpoint
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.0\.mlp\.experts\.5\.up_proj\.weight'"):
        load_model(d, F32, rank=rank, tp_size=2, moe="ep")


def test_wrong_expert_count_is_named(moe_dir, tmp_path):
    d = copy_model(moe_dir, tmp_path / "fewer")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_local_experts"] = 6  # the checkpoint has 8
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.6\..*' .*"
                                              r"config\.json has num_experts=6: experts 0\.\.5"):
        load_model(d, F32)
    d = copy_model(moe_dir, tmp_path / "router")
    _edit(d, lambda t: t.update({"model.layers.0.mlp.gate.weight": torch.zeros(7, 64)}))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.gate\.weight' has shape \[7, 64\], "
                                              r"expected \[8, 64\]"):
        load_model(d, F32, rank=1, tp_size=2, moe="ep")


def test_expert_shape_and_dense_layer_experts_are_named(moe_dir, tmp_path):
    d = copy_model(moe_dir, tmp_path / "shape")
    _edit(d, lambda t: t.update({_expert(2, "down_proj"): torch.zeros(64, 16)}))
    # rank 1 does not read expert 2 (ep), and still checks its shape
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.experts\.2\.down_proj\.weight' has shape "
                                              r"\[64, 16\], expected \[64, 32\]"):
        load_model(d, F32, rank=1, tp_size=2, moe="ep")
    d = copy_model(moe_dir, tmp_path / "dense")
    _edit(d, lambda t: t.update({_expert(0, "gate_proj", layer=1): torch.zeros(I, 64)}))
    with pytest.raises(CheckpointError, match=r"layer 1 runs the dense MLP by config\.json's mlp_only_layers"):
        load_model(d, F32)


def test_experts_not_divisible_by_cp_are_refused(moe_dir):
    with pytest.raises(ConfigError, match=r"num_experts=8 does not divide by cp_size=3; RuntimeConfig\.moe='ep'"):
        load_model(moe_dir, F32, rank=0, tp_size=3, moe="ep")
    with pytest.raises(ConfigError, match=r"intermediate size 32 does not divide by cp_size=3; RuntimeConfig\.moe='tp'"):
        load_model(moe_dir, F32, rank=0, tp_size=3, moe="tp")


def test_cli_refuses_experts_not_divisible_before_ranks_start(moe_dir, tmp_path, capsys):
    req = tmp_path / "r.jsonl"
    req.write_text('{"tokens": [1, 2, 3]}\n')
    code = main(["prefill", "--model", str(moe_dir), "--input", str(req), "--output", str(tmp_path / "o.pt"),
                 "--cp", "3", "--moe", "ep"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "num_experts=8 does not divide by --cp 3; --moe ep" in err[0], err
    assert not (tmp_path / "o.pt").exists()
    with pytest.raises(SystemExit) as e:
        main(["prefill", "--model", str(moe_dir), "--input", str(req), "--output", str(tmp_path / "o.pt"),
              "--moe", "dp"])
    assert e.value.code == 2 and "--moe: invalid choice: 'dp'" in capsys.readouterr().err


def test_expert_sizes_the_grouped_matmuls_cannot_take_are_refused(moe_dir):
    # 32 / 8 = 4 intermediate rows a rank: not 16-byte rows for torch._grouped_mm
    with pytest.raises(ConfigError, match=r"each rank's expert intermediate size is 4 \(moe='tp', cp_size=8\); .* "
                                          r"multiple of 8"):
        load_model(moe_dir, F32, rank=0, tp_size=8, moe="tp")
