"""The file transport: one safetensors file a request.

Tensors ``<name>.<layer>`` of the export's format: ``k.<layer>`` and ``v.<layer>``
(graphcp-kv/1, graphcp.pd.export), or the names a family's own format gives its
layers (``meta.layer_tensors``, graphcp.pd.formats), each in its dtype; optionally
``token_ids`` (int64) and ``last_logits`` (float32); the metadata in the safetensors
header, as strings (its ``format`` says which). A file is written to a temporary name
and renamed: a reader never sees half a file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from graphcp.pd.export import KVFormatError
from graphcp.pd.formats import Export, meta_from_dict


def _umask() -> int:
    """The process's file-creation mask (reading it means setting it: set it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_kv(export: Export, path: str | os.PathLike) -> Path:
    """Write ``export`` (either format, on any device; copied to the host) to ``path``."""
    export.check()
    path = Path(path)
    tensors = {f"{n}.{i}": export.tensor(i, n).detach().cpu().contiguous() for i, n in export.meta.tensors()}
    if export.token_ids is not None:
        tensors["token_ids"] = export.token_ids.detach().to("cpu", torch.int64).contiguous()
    if export.last_logits is not None:
        tensors["last_logits"] = export.last_logits.detach().to("cpu", torch.float32).contiguous()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=export.meta.to_dict())
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates 0600; a file is as readable as any other written
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_kv(path: str | os.PathLike, device: torch.device | str = "cpu") -> Export:
    """Read a file :func:`save_kv` wrote; KVFormatError naming the file for anything else."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            header = f.metadata() or {}
            meta = meta_from_dict(header, source=str(path))
            names = set(f.keys())
            missing = [f"{n}.{i}" for n in dict.fromkeys(n for _, n in meta.tensors()) for i, m in meta.tensors()
                       if m == n and f"{n}.{i}" not in names]
            if missing:
                raise KVFormatError(f"{path}: missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}")
            layers = [{n: f.get_tensor(f"{n}.{i}") for n in meta.layer_tensors(i)} for i in range(meta.num_layers)]
            ids = f.get_tensor("token_ids") if "token_ids" in names else None
            logits = f.get_tensor("last_logits") if "last_logits" in names else None
    except FileNotFoundError:
        raise KVFormatError(f"{path}: no such KV file") from None
    except (SafetensorError, OSError) as e:
        raise KVFormatError(f"{path}: not a readable safetensors file ({e})") from None
    return meta.make_export(layers, token_ids=ids, last_logits=logits).check(str(path))


#: safetensors' dtype names -> torch's (what a KV file holds)
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}


class KVFile:
    """A file :func:`save_kv` wrote, read in parts: its metadata, token ids and first-token
    logits at once, each tensor's positions on demand (:meth:`read_runs`), so that a rank
    importing it reads only what it keeps (graphcp.runtime.import_kv). KVFormatError naming
    the file for anything else, as :func:`read_kv`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._file = safe_open(str(self.path), framework="pt", device="cpu")
            self.meta = meta_from_dict(self._file.metadata() or {}, source=str(self.path))
            names = set(self._file.keys())
            missing = [f"{n}.{i}" for i, n in self.meta.tensors() if f"{n}.{i}" not in names]
            if missing:
                raise KVFormatError(f"{self.path}: missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}")
            self.token_ids = self._file.get_tensor("token_ids") if "token_ids" in names else None
            self.last_logits = self._file.get_tensor("last_logits") if "last_logits" in names else None
        except FileNotFoundError:
            raise KVFormatError(f"{self.path}: no such KV file") from None
        except (SafetensorError, OSError) as e:
            raise KVFormatError(f"{self.path}: not a readable safetensors file ({e})") from None

    def check(self, source: str | None = None) -> "KVFile":
        """KVFormatError unless every tensor has the metadata's shape and dtype (read from the
        file's header: no tensor is read)."""
        m = self.meta
        for i, n in m.tensors():
            part = self._file.get_slice(f"{n}.{i}")
            shape, dtype = tuple(part.get_shape()), _DTYPES.get(part.get_dtype(), part.get_dtype())
            want, want_dtype = m.tensor_shape(i, n), m.tensor_dtype(i, n)
            if shape != want or dtype != want_dtype:
                raise KVFormatError(f"{self.path}: {n}.{i} is {shape} {dtype}, expected {want} {want_dtype}")
        ids = self.token_ids
        if ids is not None and tuple(ids.shape) != (m.num_tokens,):
            raise KVFormatError(f"{self.path}: token_ids has shape {tuple(ids.shape)}, expected ({m.num_tokens},)")
        return self

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        """Tensor ``name`` of ``layer``, whole."""
        return self._file.get_tensor(f"{name}.{layer}")

    def read_runs(self, layer: int, name: str, runs: list[tuple[int, int]]) -> torch.Tensor:
        """Positions ``[start, stop)`` of each of ``runs`` of tensor ``name`` of ``layer``, in
        order along the format's token dimension (only those bytes are read)."""
        m = self.meta
        d = m.token_dim
        if not runs:
            return torch.empty(m.tensor_shape(layer, name, 0), dtype=m.tensor_dtype(layer, name))
        part = self._file.get_slice(f"{name}.{layer}")
        lead = (slice(None),) * d
        return torch.cat([part[lead + (slice(a, b),)] for a, b in runs], dim=d)
