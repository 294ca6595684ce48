"""A model fingerprint: which checkpoint a KV export was computed with.

SHA-256 of the checkpoint's ``config.json`` (as parsed JSON, keys sorted: formatting
does not count) and of every tensor's name, shape and dtype, in name order. Two
folders with the same architecture, shapes and dtypes share it; the decode side
checks it against its own model before it continues from a received KV.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from graphcp.model.loader import CheckpointError, checkpoint_files
from graphcp.pd.safetensors_lib import safe_open


def model_fingerprint(model_dir: str | Path) -> str:
    """16 hex digits identifying ``model_dir``'s config and tensor layout."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{model_dir / 'config.json'}: cannot read it for the model fingerprint ({e})") from None
    h.update(json.dumps(config, sort_keys=True).encode())
    by_file: dict[Path, list[str]] = {}
    for name, path in checkpoint_files(model_dir).items():
        by_file.setdefault(path, []).append(name)
    entries = []
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                sl = f.get_slice(name)
                entries.append(f"{name}:{list(sl.get_shape())}:{sl.get_dtype()}")
    h.update("\n".join(sorted(entries)).encode())
    return h.hexdigest()[:16]
