"""Load a Hugging Face checkpoint (config.json + model.safetensors, or a sharded
model.safetensors.index.json) into the model its family builds, tensor by tensor.

Each rank reads only what it keeps: its family's tensor table
(:meth:`graphcp.model.family.ModelFamily.tensor_table`) says where every tensor lands on
this rank (a slice of one parameter; another rank's expert is checked for shape, never
read), and under pipeline parallelism only its stage's layers are read (the embedding on
the first stage, the final norm and LM head on the last; every stage still checks that
the checkpoint lists every tensor).
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from graphcp.config import DTYPES, ParallelConfig
from graphcp.errors import InputError
from graphcp.model.config import ModelConfig
from graphcp.model.family import family_of
from graphcp.model.heads import head_shard
from graphcp.model.llama import DecoderModel
from graphcp.model.tensor_table import TensorTarget
from graphcp.options import MoeLayout
from graphcp.pd.safetensors_lib import read_errors, safe_open

# checkpoint tensors that carry no weights (older exports keep RoPE tables)
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(InputError):
    """A checkpoint folder graphcp cannot load; the message names the file and tensor."""


@contextmanager
def _reading(path: Path, what: str = "") -> Iterator[None]:
    """Turn the safetensors library's errors on a corrupt file (truncated, empty,
    garbage, a bad header) into a CheckpointError naming the file."""
    try:
        yield
    except read_errors() as e:
        raise CheckpointError(f"{path}: not a readable safetensors file{what} ({e})") from None


def _open(path: Path):
    with _reading(path):
        return safe_open(str(path), framework="pt", device="cpu")


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v and "/" not in v and v not in (".", "..")
            for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names in the same folder")
        return {name: model_dir / f for name, f in weight_map.items()}
    if single.exists():
        with _open(single) as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def model_on_meta(cfg: ModelConfig, dtype: torch.dtype, parallel: ParallelConfig, rank: int = 0, stage: int = 0,
                  moe: MoeLayout = "ep", max_positions: int | None = None, attn_rank: int = 0) -> DecoderModel:
    """Rank ``rank``'s model of pipeline stage ``stage`` on the meta device: the shapes
    of its own shards with no memory behind them (what the loader fills, and what sizes
    a rank's weights before any rank starts). ``rank``: the FFN's TP rank (the stage-local
    rank); ``attn_rank``: the attention-TP rank (its heads)."""
    shard = head_shard(cfg, parallel.attn_tp_size, attn_rank)
    with torch.device("meta"):
        return family_of(cfg).build_model(cfg, dtype, parallel, rank, stage, moe, max_positions, shard)


@dataclass
class _Plan:
    """What one rank reads of a checkpoint: each file's tensors, and where each lands."""

    targets: dict[str, TensorTarget]
    by_file: dict[Path, list[str]]


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    rank: int = 0,
    tp_size: int = 1,
    max_positions: int | None = None,
    on_tensor: Callable[[str], None] | None = None,
    moe: MoeLayout = "ep",
    parallel: ParallelConfig | None = None,
    stage: int = 0,
    attn_rank: int = 0,
) -> tuple[ModelConfig, DecoderModel]:
    """The model with this rank's weights: pipeline stage ``stage`` of ``parallel``
    (whose tp_size is the FFN's TP degree: it overrides ``tp_size``; ``rank`` is the
    stage-local rank, ``attn_rank`` the attention-TP rank whose heads it holds), or
    without ``parallel`` the whole model at ``tp_size``."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_file(model_dir / "config.json")
    parallel = parallel or ParallelConfig(cp_size=tp_size)
    family = family_of(cfg)
    family.check_parallel(cfg, parallel, str(model_dir), moe)
    model = model_on_meta(cfg, dtype, parallel, rank, stage, moe, max_positions, attn_rank)
    # materialise on the target device; the rotary tables are computed, not loaded
    model = model.to_empty(device=device)
    model.rotary = model.make_rotary(cfg, max_positions).to(device)
    params = dict(model.named_parameters())
    files = checkpoint_files(model_dir)
    table = family.tensor_table_for(cfg, rank, parallel.tp_size, moe, model.shard, frozenset(files))
    plan = _plan_reads(cfg, files, model_dir, table, model.stage.layers, params)
    filled = _read_files(cfg, model_dir, plan, params, on_tensor)
    for name, p in params.items():
        if filled[name] != p.numel():
            raise CheckpointError(f"{model_dir}: parameter {name} was only partly filled ({filled[name]}/{p.numel()})")
    return cfg, model.eval()


def _plan_reads(cfg: ModelConfig, files: dict[str, Path], model_dir: Path, table: dict[str, TensorTarget],
                layers: range, params: dict) -> _Plan:
    """Every tensor ``files`` lists checked against the table (unexpected, missing), and
    the ones this rank reads (or checks, another rank's expert) grouped by file, their
    targets renamed to this stage's parameters."""
    family = family_of(cfg)
    targets = dict(table)
    by_file: dict[Path, list[str]] = {}
    listed = set()
    for name, f in files.items():
        if IGNORED.match(name) or family.skips_tensor(cfg, name):
            continue
        if name not in targets:
            raise CheckpointError(f"{f.name}: unexpected tensor {name!r} for a {cfg.family} model of this config"
                                  + family.unexpected_hint(cfg, name))
        listed.add(name)
        tgt = targets[name]
        if not tgt.read:  # another rank's expert: its shape is checked below, it is not read
            by_file.setdefault(f, []).append(name)
            continue
        local = _stage_param(tgt.param, layers, params)
        if local is not None:  # None: another stage's tensor, not read here
            parts = tuple(replace(t, param=_stage_param(t.param, layers, params)) for t in tgt.parts)
            targets[name] = replace(tgt, param=local, parts=parts)
            by_file.setdefault(f, []).append(name)
    missing = sorted(set(targets) - listed)
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    return _Plan(targets, by_file)


def _read_files(cfg: ModelConfig, model_dir: Path, plan: _Plan, params: dict,
                on_tensor: Callable[[str], None] | None) -> dict[str, int]:
    """Read every planned tensor into its parameter; the values each parameter received."""
    declared = DTYPES.get(cfg.torch_dtype) if cfg.torch_dtype else None
    filled: dict[str, int] = {name: 0 for name in params}
    with torch.no_grad():
        for f, names in plan.by_file.items():
            if not f.exists():
                raise CheckpointError(f"{model_dir}: index names {f.name}, which does not exist")
            with _open(f) as sf:
                for name in names:
                    first = plan.targets[name]
                    if not first.read:  # another rank's expert: checked, not read
                        _read_checked(sf, f, name, first, declared, cfg.torch_dtype)
                        continue
                    for tgt in (first, *first.parts):  # (parts: more slices of the same tensor)
                        t = _read_checked(sf, f, name, tgt, declared, cfg.torch_dtype)
                        _place(params, f, sf, name, tgt, t)
                        filled[tgt.param] += t.numel()
                    if on_tensor is not None:
                        on_tensor(name)
    return filled


def _place(params: dict, f: Path, sf, name: str, tgt: TensorTarget, t: torch.Tensor) -> None:
    """Copy one slice ``t`` of checkpoint tensor ``name`` where its target says."""
    p = params[tgt.param] if tgt.index is None else params[tgt.param][tgt.index]
    dst = p.narrow(tgt.dim, tgt.start, t.shape[tgt.dim]) if t.dim() > tgt.dim else p
    if tuple(dst.shape) != tuple(t.shape) or tgt.start + t.shape[tgt.dim] > p.shape[tgt.dim]:
        raise CheckpointError(f"{f.name}: tensor {name!r} has shape {list(_shape(sf, f, name))}, "
                              f"expected {list(tgt.shape)}")
    dst.copy_(t)


def _shape(sf, f: Path, name: str) -> tuple[int, ...]:
    with _reading(f, f" at tensor {name!r}"):
        return tuple(sf.get_slice(name).get_shape())


def _read_checked(sf, f: Path, name: str, tgt: TensorTarget, declared: torch.dtype | None,
                  declared_name: str | None) -> torch.Tensor | None:
    """One tensor's slice for this rank, its shape checked on the whole checkpoint tensor
    (a wrong size along a fused or sharded dim would otherwise fit its slice, or run past
    it) and its dtype against the table and config.json; None for another rank's expert."""
    with _reading(f, f" at tensor {name!r}"):
        sl = sf.get_slice(name)
        shape = tuple(sl.get_shape())
        st_dtype = sl.get_dtype()
    if shape != tgt.shape:
        raise CheckpointError(f"{f.name}: tensor {name!r} has shape {list(shape)}, expected {list(tgt.shape)}")
    if not tgt.read:
        return None
    with _reading(f, f" at tensor {name!r}"):
        t = _read(sl, shape, tgt)
    if tgt.integer:
        if t.is_floating_point() or t.is_complex():
            raise CheckpointError(f"{f.name}: tensor {name!r} has dtype {st_dtype}, expected an integer table")
    elif not t.is_floating_point():
        raise CheckpointError(f"{f.name}: tensor {name!r} has dtype {st_dtype}, expected a float type")
    elif declared is not None and t.dtype != declared and not (tgt.float32 and t.dtype == torch.float32):
        raise CheckpointError(f"{f.name}: tensor {name!r} has dtype {t.dtype}, config.json declares {declared_name}")
    return t


def _stage_param(param: str, layers: range, params: dict) -> str | None:
    """This stage's name for a whole-model parameter (``layers.{i}.`` renumbered from
    the stage's first layer), or None when another stage holds it."""
    if param.startswith("layers."):
        i = int(param.split(".", 2)[1])
        if i not in layers:
            return None
        param = f"layers.{i - layers.start}." + param.split(".", 2)[2]
    return param if param in params else None


def _read(sl, shape: tuple[int, ...], tgt: TensorTarget) -> torch.Tensor:
    if tgt.shard is None:
        return sl[:]
    dim, start, length = tgt.shard
    if dim >= len(shape) or start + length > shape[dim]:
        # let the caller's shape check name the tensor
        return sl[:]
    return sl[(slice(None),) * dim + (slice(start, start + length),)]
