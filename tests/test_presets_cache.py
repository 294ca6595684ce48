"""The presets' cache: seeded weights are the same bytes every time, and a folder cached
under an older recipe or config (a user's default model from before a recipe change) is
written again, while a current one is kept as it is."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from graphcp.model.family import family_named
from graphcp.model.presets import PRESETS, RECIPE_FILE, SEED, ensure_preset, random_weights


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_same_seed_same_bytes():
    config = PRESETS["default"]
    assert _same(random_weights(config, SEED), random_weights(config, SEED))
    assert not _same(random_weights(config, SEED), random_weights(config, SEED + 1))


def test_a_current_folder_is_kept(tmp_path):
    folder = ensure_preset("default", root=tmp_path)
    recipe = json.loads((folder / RECIPE_FILE).read_text())
    assert recipe == {"family": "dense decoder", "recipe": family_named("qwen3").weights_recipe, "seed": SEED}
    before = (folder / "model.safetensors").stat()
    assert ensure_preset("default", root=tmp_path) == folder
    after = (folder / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_folder_of_an_older_recipe_is_written_again(tmp_path):
    folder = ensure_preset("default", root=tmp_path)
    want = _weights(folder)
    # as an older graphcp left it: other weights, no recipe file
    save_file({k: torch.zeros_like(v) for k, v in want.items()}, str(folder / "model.safetensors"))
    (folder / RECIPE_FILE).unlink()
    assert ensure_preset("default", root=tmp_path) == folder
    assert _same(_weights(folder), want) and (folder / RECIPE_FILE).exists()
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == ["default"]  # nothing left aside


def test_a_folder_of_another_config_or_recipe_version_is_written_again(tmp_path, monkeypatch):
    folder = ensure_preset("default", root=tmp_path)
    (folder / "config.json").write_text(json.dumps({**PRESETS["default"], "num_hidden_layers": 2}))
    ensure_preset("default", root=tmp_path)
    assert json.loads((folder / "config.json").read_text()) == PRESETS["default"]
    dense = family_named("qwen3")
    monkeypatch.setattr(type(dense), "weights_recipe", dense.weights_recipe + 1)
    ensure_preset("default", root=tmp_path)
    assert json.loads((folder / RECIPE_FILE).read_text())["recipe"] == dense.weights_recipe
