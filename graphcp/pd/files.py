"""The file transport: one safetensors file a request.

Tensors ``k.<layer>`` and ``v.<layer>`` (graphcp-kv/1 layout, graphcp.pd.export),
optionally ``token_ids`` (int64) and ``last_logits`` (float32); the metadata
(:class:`KVMeta`) in the safetensors header, as strings. A file is written to a
temporary name and renamed: a reader never sees half a file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from graphcp.pd.export import KVExport, KVFormatError, KVMeta


def save_kv(export: KVExport, path: str | os.PathLike) -> Path:
    """Write ``export`` (on any device; copied to the host) to ``path``."""
    export.check()
    path = Path(path)
    tensors = {}
    for i in range(export.meta.num_layers):
        tensors[f"k.{i}"] = export.k[i].detach().cpu().contiguous()
        tensors[f"v.{i}"] = export.v[i].detach().cpu().contiguous()
    if export.token_ids is not None:
        tensors["token_ids"] = export.token_ids.detach().to("cpu", torch.int64).contiguous()
    if export.last_logits is not None:
        tensors["last_logits"] = export.last_logits.detach().to("cpu", torch.float32).contiguous()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=export.meta.to_dict())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_kv(path: str | os.PathLike, device: torch.device | str = "cpu") -> KVExport:
    """Read a file :func:`save_kv` wrote; KVFormatError naming the file for anything else."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            header = f.metadata() or {}
            meta = KVMeta.from_dict(header, source=str(path))
            names = set(f.keys())
            want = {f"{kind}.{i}" for kind in "kv" for i in range(meta.num_layers)}
            if not want <= names:
                missing = sorted(want - names, key=lambda n: (n[0], int(n[2:])))
                raise KVFormatError(f"{path}: missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}")
            k = [f.get_tensor(f"k.{i}") for i in range(meta.num_layers)]
            v = [f.get_tensor(f"v.{i}") for i in range(meta.num_layers)]
            ids = f.get_tensor("token_ids") if "token_ids" in names else None
            logits = f.get_tensor("last_logits") if "last_logits" in names else None
    except FileNotFoundError:
        raise KVFormatError(f"{path}: no such KV file") from None
    except (SafetensorError, OSError) as e:
        raise KVFormatError(f"{path}: not a readable safetensors file ({e})") from None
    return KVExport(meta, k, v, ids, logits).check(str(path))
