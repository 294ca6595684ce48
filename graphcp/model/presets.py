"""Built-in model presets: small configs with seeded random weights, written once
in Hugging Face format (config.json + model.safetensors) to a cache folder and
then loaded like any checkpoint (transformers loads the same folder). Each family
offers its own (:attr:`graphcp.model.family.ModelFamily.presets`).

A folder also names the recipe that wrote it (:data:`RECIPE_FILE`: the family's
``weights_recipe`` and the seed); one whose config.json or recipe differs from what the
preset asks now (a folder cached before the recipe changed) is written again.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from graphcp.errors import ConfigError
from graphcp.model.config import model_type_of
from graphcp.model.family import all_presets, family_named
from graphcp.pd.safetensors_lib import save_file


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
#: the file in a written folder that names the recipe of its weights
RECIPE_FILE = "graphcp-recipe.json"


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
    weights, written on first use and again when its recipe changed (atomically); a
    preset, or a variant of one."""
    folder = (root or cache_root()) / "models" / name
    return ensure_model_folder(folder, config, weights_recipe(config), lambda _: random_weights(config))


def weights_recipe(config: dict, seed: int = SEED) -> dict:
    """What, besides config.json, the bytes of ``random_weights(config, seed)`` follow from."""
    family = family_named(model_type_of(config, "preset"))
    return {"family": family.name, "recipe": family.weights_recipe, "seed": seed}


def ensure_model_folder(folder: Path, config: dict, recipe: dict,
                        weights: Callable[[Path], dict[str, torch.Tensor]]) -> Path:
    """``folder`` as :func:`write_model_folder` writes it, kept while it holds ``config``
    written under ``recipe`` and written (again) otherwise."""
    if is_current(folder, config, recipe):
        return folder
    return write_model_folder(folder, config, weights, recipe)


def is_current(folder: Path, config: dict, recipe: dict | None) -> bool:
    """Whether ``folder`` holds weights and ``config``, written under ``recipe``."""
    try:
        same_config = json.loads((folder / "config.json").read_text()) == json.loads(json.dumps(config))
        same_recipe = recipe is None or json.loads((folder / RECIPE_FILE).read_text()) == recipe
    except (OSError, ValueError):  # missing or half-written: not current
        return False
    return same_config and same_recipe and (folder / "model.safetensors").exists()


def write_model_folder(folder: Path, config: dict, weights: Callable[[Path], dict[str, torch.Tensor]],
                       recipe: dict | None = None) -> Path:
    """Write ``config.json``, ``model.safetensors`` (``weights(dir)``, called once the
    config is in ``dir``) and ``recipe`` (:data:`RECIPE_FILE`) as ``folder``, atomically,
    replacing an older one: of two processes writing the same folder at once, one wins
    whole and the other's copy is dropped."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(weights(tmp), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if recipe is not None:
            (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
        if folder.exists() and not is_current(folder, config, recipe):
            _discard(folder)
        try:
            tmp.rename(folder)
        except OSError:
            if not is_current(folder, config, recipe):  # not another process winning the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _discard(folder: Path) -> None:
    """Delete ``folder`` after moving it aside in one rename (a reader never sees it half
    deleted; another process may have moved it first)."""
    aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}-old-", dir=folder.parent))
    try:
        folder.rename(aside)  # over the empty folder mkdtemp made
    except FileNotFoundError:
        pass
    finally:
        shutil.rmtree(aside, ignore_errors=True)


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
