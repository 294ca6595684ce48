"""The safetensors library, imported on first use. graphcp's files (checkpoints, presets,
KV files) are read and written through it, but an image without it (or with a broken
build) must still import graphcp: the GPU check then says so in its report and runs the
parts that need no file, instead of dying before any report."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

_lib: ModuleType | None = None


def problem() -> str | None:
    """Why safetensors cannot be used here (one line), or None."""
    try:
        _import()
    except ImportError as e:
        return str(e)
    return None


def _import() -> ModuleType:
    global _lib
    if _lib is None:
        try:
            importlib.import_module("safetensors.torch")
            _lib = importlib.import_module("safetensors")
        except ImportError as e:
            raise ImportError(f"the safetensors package cannot be imported ({e}): graphcp reads and writes "
                              "checkpoints, presets and KV files with it; pip install safetensors") from None
    return _lib


def safe_open(path: str, framework: str, device: str = "cpu") -> Any:
    """``safetensors.safe_open`` (ImportError saying what is missing without the package)."""
    return _import().safe_open(path, framework=framework, device=device)


def save_file(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file``."""
    _import()
    importlib.import_module("safetensors.torch").save_file(tensors, path, metadata=metadata)


def read_errors() -> tuple[type[BaseException], ...]:
    """What reading a corrupt file raises (``SafetensorError``, ``OSError``): for an
    ``except`` clause, evaluated only when something was raised."""
    try:
        return (_import().SafetensorError, OSError)
    except ImportError:
        return (OSError,)
