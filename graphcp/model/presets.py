"""Built-in model presets: small configs with seeded random weights, written once
in Hugging Face format (config.json + model.safetensors) to a cache folder and
then loaded like any checkpoint (transformers loads the same folder). Each family
offers its own (:attr:`graphcp.model.family.ModelFamily.presets`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from graphcp.errors import ConfigError
from graphcp.model.config import model_type_of
from graphcp.model.family import all_presets, family_named


class _Presets(Mapping):
    """Every registered family's presets by name (a live view: a family registered later
    adds its own)."""

    def __getitem__(self, name: str) -> dict:
        return all_presets()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(all_presets())

    def __len__(self) -> int:
        return len(all_presets())


#: name -> config.json of every built-in preset
PRESETS: Mapping[str, dict] = _Presets()
SEED = 1234


def cache_root() -> Path:
    return Path(os.environ.get("GRAPHCP_CACHE", Path.home() / ".cache" / "graphcp"))


def is_preset(name: str) -> bool:
    return name in PRESETS


def random_weights(config: dict, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Seeded HF-named tensors for a config.json, as its family writes them."""
    return family_named(model_type_of(config, "preset")).random_weights(config, seed)


def ensure_preset(name: str, root: Path | None = None) -> Path:
    """The preset's checkpoint folder, written on first use (atomically)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    return ensure_random_model(name, PRESETS[name], root)


def ensure_random_model(name: str, config: dict, root: Path | None = None) -> Path:
    """Checkpoint folder ``<root>/models/<name>`` of ``config`` with seeded random
    weights, written on first use (atomically); a preset, or a variant of one."""
    folder = (root or cache_root()) / "models" / name
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    return write_model_folder(folder, config, lambda _: random_weights(config))


def write_model_folder(folder: Path, config: dict, weights: Callable[[Path], dict[str, torch.Tensor]]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (``weights(dir)``, called once the
    config is in ``dir``) as ``folder``, atomically: of two processes writing the same
    folder at once, one wins whole and the other's copy is dropped."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(weights(tmp), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "config.json").exists():  # not another process winning the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def resolve_model(name_or_dir: str | os.PathLike, what: str = "model") -> Path:
    """A preset name or a checkpoint folder -> the folder (``what``: its name in errors,
    ``--model`` on the command line)."""
    s = str(name_or_dir)
    if is_preset(s) and not Path(s).exists():
        return ensure_preset(s)
    p = Path(s)
    if not p.is_dir():
        raise ConfigError(f"{what} {s!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a checkpoint folder")
    return p
