"""Load a Hugging Face checkpoint (config.json + model.safetensors, or a sharded
model.safetensors.index.json) into a :class:`DecoderModel`, tensor by tensor.

Each rank reads only what it keeps: attention weights whole, the MLP's gate/up
rows and down columns of its TP shard, and under pipeline parallelism only its
stage's layers (the embedding on the first stage, the final norm and LM head on
the last; every stage still checks that the checkpoint lists every tensor). q/k/v
are fused into one projection and gate/up into one, so every checkpoint tensor
maps to a slice of one parameter.

Mixture-of-experts layers (Hub format: one tensor per expert per projection, as
transformers saves them; Qwen3-MoE ``mlp.experts.{e}.gate_proj``/``up_proj``/
``down_proj``, Mixtral ``block_sparse_moe.experts.{e}.w1``/``w3``/``w2``): the router
whole; with ``moe="ep"`` only this rank's experts, whole (the others' tensors are
checked for shape, never read); with ``moe="tp"`` every expert's TP shard.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from graphcp.config import DTYPES, ParallelConfig
from graphcp.errors import InputError
from graphcp.model.config import ModelConfig
from graphcp.model.dsa.checkpoint import dsa_tensors, is_skipped
from graphcp.model.dsa.model import DsaModel
from graphcp.model.dsv4.checkpoint import dsv4_tensors
from graphcp.model.dsv4.model import DsV4Model
from graphcp.model.heads import HeadShard, head_shard
from graphcp.model.llama import DecoderModel
from graphcp.model.moe_config import MOE_NAMES
from graphcp.options import MoeLayout

# checkpoint tensors that carry no weights (older exports keep RoPE tables)
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
#: an expert's tensor: model.layers.{layer}.{mlp|block_sparse_moe}.experts.{expert}.{projection}.weight
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")


class CheckpointError(InputError):
    """A checkpoint folder graphcp cannot load; the message names the file and tensor."""


@contextmanager
def _reading(path: Path, what: str = "") -> Iterator[None]:
    """Turn the safetensors library's errors on a corrupt file (truncated, empty,
    garbage, a bad header) into a CheckpointError naming the file."""
    try:
        yield
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file{what} ({e})") from None


def _open(path: Path):
    with _reading(path):
        return safe_open(str(path), framework="pt", device="cpu")


@dataclass(frozen=True)
class _Target:
    param: str  # our parameter name
    dim: int  # dim of the parameter that the slice runs along
    start: int  # where the (possibly sharded) checkpoint slice lands
    shard: tuple[int, int, int] | None = None  # (dim, start, length) taken from the checkpoint tensor
    index: int | None = None  # the slice lands in ``param[index]`` (a local expert), then as above


def _targets(cfg: ModelConfig, rank: int, tp: int, moe: MoeLayout = "ep",
             shard: HeadShard | None = None) -> dict[str, _Target | None]:
    """Checkpoint tensor -> where it lands (None: another rank's expert, checked not read).
    ``rank``/``tp``: the FFN's TP rank and degree; ``shard``: this rank's attention heads."""
    heads = shard or head_shard(cfg)
    t: dict[str, _Target] = {
        "model.embed_tokens.weight": _Target("embed_tokens.weight", 0, 0),
        "model.norm.weight": _Target("norm.weight", 0, 0),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = _Target("lm_head.weight", 0, 0)
    shard = cfg.intermediate_size // tp
    for i in range(cfg.num_layers):
        hf, me = f"model.layers.{i}.", f"layers.{i}."
        t[hf + "input_layernorm.weight"] = _Target(me + "input_layernorm.weight", 0, 0)
        t[hf + "post_attention_layernorm.weight"] = _Target(me + "post_attention_layernorm.weight", 0, 0)
        for name, off, rows in _qkv_slices(cfg, heads):
            t[hf + f"self_attn.{name}.weight"] = _Target(me + "self_attn.qkv.weight", 0, off, rows)
            if cfg.attention_bias:
                t[hf + f"self_attn.{name}.bias"] = _Target(me + "self_attn.qkv.bias", 0, off, rows)
        o_cols = None if not heads.split else (1, heads.q_start * cfg.head_dim, heads.num_heads * cfg.head_dim)
        t[hf + "self_attn.o_proj.weight"] = _Target(me + "self_attn.o_proj.weight", 1, 0, o_cols)
        if cfg.o_bias:
            t[hf + "self_attn.o_proj.bias"] = _Target(me + "self_attn.o_proj.bias", 0, 0)
        if cfg.qk_norm:
            t[hf + "self_attn.q_norm.weight"] = _Target(me + "self_attn.q_norm.weight", 0, 0)
            t[hf + "self_attn.k_norm.weight"] = _Target(me + "self_attn.k_norm.weight", 0, 0)
        if cfg.moe is not None and cfg.moe.is_sparse(i):
            t.update(_moe_targets(cfg, i, rank, tp, moe))
            continue
        rows = (0, rank * shard, shard)
        t[hf + "mlp.gate_proj.weight"] = _Target(me + "mlp.gate_up.weight", 0, 0, rows)
        t[hf + "mlp.up_proj.weight"] = _Target(me + "mlp.gate_up.weight", 0, shard, rows)
        t[hf + "mlp.down_proj.weight"] = _Target(me + "mlp.down.weight", 1, 0, (1, rank * shard, shard))
        if cfg.mlp_bias:
            t[hf + "mlp.gate_proj.bias"] = _Target(me + "mlp.gate_up.bias", 0, 0, rows)
            t[hf + "mlp.up_proj.bias"] = _Target(me + "mlp.gate_up.bias", 0, shard, rows)
            t[hf + "mlp.down_proj.bias"] = _Target(me + "mlp.down_bias", 0, 0)
    return t


def _qkv_slices(cfg: ModelConfig, shard: HeadShard) -> list[tuple[str, int, tuple[int, int, int] | None]]:
    """q/k/v: (name, offset in the fused projection, rows read: this rank's heads, or all)."""
    d = cfg.head_dim
    q, kv = shard.num_heads * d, shard.num_kv_heads * d
    if not shard.split:
        return [("q_proj", 0, None), ("k_proj", q, None), ("v_proj", q + kv, None)]
    k_rows = (0, shard.kv_start * d, kv)
    return [("q_proj", 0, (0, shard.q_start * d, q)), ("k_proj", q, k_rows), ("v_proj", q + kv, k_rows)]


def _moe_targets(cfg: ModelConfig, i: int, rank: int, tp: int, moe: MoeLayout) -> dict[str, _Target | None]:
    """One sparse layer's router and experts (see the module doc)."""
    m = cfg.moe
    module, (gate, up, down) = MOE_NAMES[cfg.family]
    hf, me = f"model.layers.{i}.{module}.", f"layers.{i}.mlp."
    t: dict[str, _Target | None] = {hf + "gate.weight": _Target(me + "router.weight", 0, 0)}
    if moe == "ep":
        local = m.num_experts // tp
        for e in range(m.num_experts):
            mine = e // local == rank
            t[hf + f"experts.{e}.{gate}.weight"] = _Target(me + "experts.gate_up", 0, 0, None, e % local) if mine else None
            t[hf + f"experts.{e}.{up}.weight"] = (_Target(me + "experts.gate_up", 0, m.intermediate_size, None, e % local)
                                                  if mine else None)
            t[hf + f"experts.{e}.{down}.weight"] = _Target(me + "experts.down", 0, 0, None, e % local) if mine else None
        return t
    shard = m.intermediate_size // tp
    rows = (0, rank * shard, shard)
    for e in range(m.num_experts):
        t[hf + f"experts.{e}.{gate}.weight"] = _Target(me + "experts.gate_up", 0, 0, rows, e)
        t[hf + f"experts.{e}.{up}.weight"] = _Target(me + "experts.gate_up", 0, shard, rows, e)
        t[hf + f"experts.{e}.{down}.weight"] = _Target(me + "experts.down", 1, 0, (1, rank * shard, shard), e)
    return t


def _unexpected_hint(cfg: ModelConfig, name: str) -> str:
    """Why an unexpected tensor is unexpected, when it looks like an expert's."""
    if cfg.moe is None:
        return ""
    if ".experts." in name and not EXPERT.match(name):
        return " (graphcp reads the Hub format: one tensor per expert per projection)"
    hit = EXPERT.match(name)
    if hit is None:
        return ""
    layer, expert = int(hit.group(1)), int(hit.group(2))
    if expert >= cfg.moe.num_experts:
        return f" (config.json has num_experts={cfg.moe.num_experts}: experts 0..{cfg.moe.num_experts - 1})"
    if layer < cfg.num_layers and not cfg.moe.is_sparse(layer):
        return f" (layer {layer} runs the dense MLP by config.json's mlp_only_layers / decoder_sparse_step)"
    return ""


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
        if cfg.dsv4 is not None:
            return DsV4Model(cfg, parallel.tp_size, dtype, max_positions, rank, moe,
                             parallel.stage(stage, cfg.num_layers), shard)
        if cfg.dsa is not None:
            return DsaModel(cfg, parallel.tp_size, dtype, max_positions, rank, moe,
                            parallel.stage(stage, cfg.num_layers))
        return DecoderModel(cfg, parallel.tp_size, dtype, max_positions, rank, moe,
                            parallel.stage(stage, cfg.num_layers), shard)


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
    cfg.check_parallel(parallel, str(model_dir), moe)
    tp_size = parallel.tp_size
    declared = DTYPES.get(cfg.torch_dtype) if cfg.torch_dtype else None
    tabled = cfg.dsa is not None or cfg.dsv4 is not None  # DSA and V4: a table of their own
    model = model_on_meta(cfg, dtype, parallel, rank, stage, moe, max_positions, attn_rank)
    # materialise on the target device; the rotary tables are computed, not loaded
    model = model.to_empty(device=device)
    model.rotary = model.make_rotary(cfg, max_positions).to(device)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}
    if tabled:  # graphcp/model/dsa/checkpoint.py, graphcp/model/dsv4/checkpoint.py
        table = (dsa_tensors(cfg, rank, tp_size, moe) if cfg.dsv4 is None
                 else dsv4_tensors(cfg, rank, tp_size, moe, model.shard))
        targets = {n: _Target(t.param, t.dim, t.start, t.shard, t.index) if t.read else None
                   for n, t in table.items()}
        expected = {n: t.shape for n, t in table.items()}
        float32 = {n for n, t in table.items() if t.float32}
        integer = {n for n, t in table.items() if t.integer}
    else:
        targets, expected, float32 = _targets(cfg, rank, tp_size, moe, model.shard), None, set()
        integer = set()
    files = checkpoint_files(model_dir)
    by_file: dict[Path, list[str]] = {}
    listed = set()
    for name, f in files.items():
        if IGNORED.match(name) or (tabled and is_skipped(name, cfg.num_layers)):
            continue
        if name not in targets:
            raise CheckpointError(f"{f.name}: unexpected tensor {name!r} for a {cfg.family} model of this config"
                                  + _unexpected_hint(cfg, name))
        listed.add(name)
        tgt = targets[name]
        if tgt is None:  # another rank's expert: its shape is checked below, it is not read
            by_file.setdefault(f, []).append(name)
            continue
        local = _stage_param(tgt.param, model.stage.layers, params)
        if local is not None:  # None: another stage's tensor, not read here
            targets[name] = replace(tgt, param=local)
            by_file.setdefault(f, []).append(name)
    missing = sorted(set(targets) - listed)
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    with torch.no_grad():
        for f, names in by_file.items():
            if not f.exists():
                raise CheckpointError(f"{model_dir}: index names {f.name}, which does not exist")
            with _open(f) as sf:
                for name in names:
                    tgt = targets[name]
                    with _reading(f, f" at tensor {name!r}"):
                        sl = sf.get_slice(name)
                        shape = tuple(sl.get_shape())
                        st_dtype = sl.get_dtype()
                    full = _expected_shape(cfg, name) if expected is None else expected[name]
                    if shape != full:
                        # checked on the whole checkpoint tensor: a wrong size along a fused or
                        # sharded dim would otherwise fit its slice (or run past it)
                        raise CheckpointError(
                            f"{f.name}: tensor {name!r} has shape {list(shape)}, expected {list(full)}"
                        )
                    if tgt is None:  # another rank's expert: checked above, not read
                        continue
                    with _reading(f, f" at tensor {name!r}"):
                        t = _read(sl, shape, tgt)
                    if name in integer:
                        if t.is_floating_point() or t.is_complex():
                            raise CheckpointError(f"{f.name}: tensor {name!r} has dtype {st_dtype}, expected an "
                                                  "integer table")
                    elif not t.is_floating_point():
                        raise CheckpointError(f"{f.name}: tensor {name!r} has dtype {st_dtype}, expected a float type")
                    elif declared is not None and t.dtype != declared and not (name in float32 and t.dtype == torch.float32):
                        raise CheckpointError(
                            f"{f.name}: tensor {name!r} has dtype {t.dtype}, config.json declares {cfg.torch_dtype}"
                        )
                    p = params[tgt.param] if tgt.index is None else params[tgt.param][tgt.index]
                    dst = p.narrow(tgt.dim, tgt.start, t.shape[tgt.dim]) if t.dim() > tgt.dim else p
                    if tuple(dst.shape) != tuple(t.shape) or tgt.start + t.shape[tgt.dim] > p.shape[tgt.dim]:
                        raise CheckpointError(
                            f"{f.name}: tensor {name!r} has shape {list(shape)}, expected {list(full)}"
                        )
                    dst.copy_(t)
                    filled[tgt.param] += t.numel()
                    if on_tensor is not None:
                        on_tensor(name)
    for name, p in params.items():
        if filled[name] != p.numel():
            raise CheckpointError(f"{model_dir}: parameter {name} was only partly filled ({filled[name]}/{p.numel()})")
    return cfg, model.eval()


def _stage_param(param: str, layers: range, params: dict) -> str | None:
    """This stage's name for a whole-model parameter (``layers.{i}.`` renumbered from
    the stage's first layer), or None when another stage holds it."""
    if param.startswith("layers."):
        i = int(param.split(".", 2)[1])
        if i not in layers:
            return None
        param = f"layers.{i - layers.start}." + param.split(".", 2)[2]
    return param if param in params else None


def _read(sl, shape: tuple[int, ...], tgt: _Target) -> torch.Tensor:
    if tgt.shard is None:
        return sl[:]
    dim, start, length = tgt.shard
    if dim >= len(shape) or start + length > shape[dim]:
        # let the caller's shape check name the tensor
        return sl[:]
    return sl[start : start + length] if dim == 0 else sl[:, start : start + length]


def _expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    if cfg.moe is not None and (EXPERT.match(name) or name.endswith(".gate.weight")):
        h, i = cfg.hidden_size, cfg.moe.intermediate_size
        moe_table = {"gate": (cfg.moe.num_experts, h), "gate_proj": (i, h), "up_proj": (i, h), "w1": (i, h),
                     "w3": (i, h), "down_proj": (h, i), "w2": (h, i)}
        return moe_table.get(name.split(".")[-2], ())
    h, i, qs, kvs = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    table = {
        "embed_tokens.weight": (cfg.vocab_size, h), "lm_head.weight": (cfg.vocab_size, h),
        "norm.weight": (h,), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "q_proj.weight": (qs, h), "k_proj.weight": (kvs, h),
        "v_proj.weight": (kvs, h), "q_proj.bias": (qs,), "k_proj.bias": (kvs,), "v_proj.bias": (kvs,),
        "o_proj.weight": (h, qs), "o_proj.bias": (h,), "q_norm.weight": (cfg.head_dim,),
        "k_norm.weight": (cfg.head_dim,), "gate_proj.weight": (i, h), "up_proj.weight": (i, h),
        "down_proj.weight": (h, i), "gate_proj.bias": (i,), "up_proj.bias": (i,), "down_proj.bias": (h,),
    }
    # match the last two name components exactly: "q_norm.weight" must not match "norm.weight"
    return table.get(".".join(name.split(".")[-2:]), ())
