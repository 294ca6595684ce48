"""Load an EAGLE-3 draft checkpoint in the public format (SGLang's
``LlamaForCausalLMEagle3``, written by SpecForge and the EAGLE repository):
``config.json`` and ``model.safetensors`` (or a sharded index) holding

    fc.weight [H, 3H] (fc.bias [H] when config.json's "bias" is true)
    midlayer.input_layernorm.weight, midlayer.hidden_norm.weight,
    midlayer.post_attention_layernorm.weight [H]
    midlayer.self_attn.{q,k,v}_proj.weight [q | kv, 2H], midlayer.self_attn.o_proj.weight [H, q]
    midlayer.mlp.{gate,up}_proj.weight [I, H], midlayer.mlp.down_proj.weight [H, I]
    norm.weight [H], lm_head.weight [draft_vocab, H]
    d2t int64 [draft_vocab] (target id - draft id), t2d bool [vocab] (which target ids the draft has)

(names may carry a ``model.`` prefix; an ``embed_tokens.weight`` is checked and not
read: the draft embeds with the target's embedding). A missing, unexpected or
mis-shaped tensor is a one-line CheckpointError."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from graphcp.model.config import ModelConfig
from graphcp.model.eagle3.config import Eagle3Config, read_eagle3_config
from graphcp.model.eagle3.layer import Eagle3Draft
from graphcp.model.heads import HeadShard
from graphcp.model.layers import Rotary
from graphcp.model.loader import CheckpointError, checkpoint_files
from graphcp.pd.safetensors_lib import read_errors, safe_open


def draft_tensors(cfg: Eagle3Config) -> dict[str, tuple[str | None, tuple[int, ...]]]:
    """Checkpoint name -> (our parameter or buffer, None: checked only; expected shape)."""
    c = cfg.layer
    h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    m = "midlayer."
    t = {
        "fc.weight": ("fc.weight", (h, 3 * h)),
        m + "input_layernorm.weight": ("input_layernorm.weight", (h,)),
        m + "hidden_norm.weight": ("hidden_norm.weight", (h,)),
        m + "post_attention_layernorm.weight": ("post_attention_layernorm.weight", (h,)),
        m + "self_attn.q_proj.weight": ("self_attn.qkv.weight", (q, 2 * h)),
        m + "self_attn.k_proj.weight": ("self_attn.qkv.weight", (kv, 2 * h)),
        m + "self_attn.v_proj.weight": ("self_attn.qkv.weight", (kv, 2 * h)),
        m + "self_attn.o_proj.weight": ("self_attn.o_proj.weight", (h, q)),
        m + "mlp.gate_proj.weight": ("mlp.gate_up.weight", (i, h)),
        m + "mlp.up_proj.weight": ("mlp.gate_up.weight", (i, h)),
        m + "mlp.down_proj.weight": ("mlp.down.weight", (h, i)),
        "norm.weight": ("norm.weight", (h,)),
        "lm_head.weight": ("lm_head.weight", (cfg.draft_vocab_size, h)),
        "d2t": ("d2t", (cfg.draft_vocab_size,)),
        "t2d": (None, (c.vocab_size,)),
    }
    if cfg.fc_bias:
        t["fc.bias"] = ("fc.bias", (h,))
    return t


#: where a fused parameter's part starts (rows), by checkpoint name suffix (``mine``: this
#: rank's head counts)
def _offsets(cfg: Eagle3Config, mine: ModelConfig) -> dict[str, int]:
    return {"k_proj.weight": mine.q_size, "v_proj.weight": mine.q_size + mine.kv_size,
            "up_proj.weight": cfg.layer.intermediate_size}


def _heads(name: str, t: torch.Tensor, shard: HeadShard, head_dim: int) -> torch.Tensor:
    """A checkpoint tensor's part of this rank's heads (attention TP): q/k/v's rows, o_proj's
    columns; any other tensor whole."""
    if not shard.split:
        return t
    if name.endswith("q_proj.weight"):
        return t.narrow(0, shard.q_start * head_dim, shard.num_heads * head_dim)
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        return t.narrow(0, shard.kv_start * head_dim, shard.num_kv_heads * head_dim)
    if name.endswith("o_proj.weight"):
        return t.narrow(1, shard.q_start * head_dim, shard.num_heads * head_dim)
    return t


def load_draft(folder: str | Path, target: ModelConfig, embed: nn.Embedding, dtype: torch.dtype,
               device: torch.device | str, max_positions: int, shard: HeadShard | None = None) -> Eagle3Draft:
    """The draft, its weights read from ``folder``, its KV the layer after the target's
    (``target.num_layers``), embedding with the target's ``embed``; ``shard``: this rank's
    heads under attention TP (the target's)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"draft: {folder} is not a folder (expected an EAGLE-3 checkpoint)")
    cfg = read_eagle3_config(folder, target)
    with torch.device("meta"):
        model = Eagle3Draft(cfg, target.num_layers, embed, dtype, max_positions, shard)
    model = model.to_empty(device=device)
    model.rotary = Rotary(cfg.layer.head_dim, max_positions, cfg.layer.rope).to(device)  # computed, not loaded
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    table = draft_tensors(cfg)
    # the target's embedding: checked, never read
    optional = {"embed_tokens.weight": (cfg.layer.vocab_size, cfg.hidden_size)}
    shard = model.self_attn.shard
    offsets = _offsets(cfg, model.self_attn.cfg)
    files = {_strip(n): (n, f) for n, f in checkpoint_files(folder).items()}
    for name in files:
        if name not in table and name not in optional:
            raise CheckpointError(f"{folder}: unexpected tensor {files[name][0]!r} in an EAGLE-3 draft checkpoint")
    missing = [n for n in table if n not in files]
    if missing:
        raise CheckpointError(f"{folder}: missing tensor {missing[0]!r} of the EAGLE-3 draft "
                              f"({len(missing)} missing in all)")
    t2d = None
    with torch.no_grad():
        for name, (stored, f) in files.items():
            t = _read(f, stored)
            param, want = table[name] if name in table else (None, optional[name])
            if tuple(t.shape) != want:
                raise CheckpointError(f"{f.name}: tensor {stored!r} has shape {list(t.shape)}, expected {list(want)}")
            if name == "d2t" or name == "t2d":
                kinds = {"d2t": "an integer", "t2d": "a bool"}
                ok = (t.dtype == torch.bool) if name == "t2d" else not (t.is_floating_point() or t.dtype == torch.bool)
                if not ok:
                    raise CheckpointError(
                        f"{f.name}: tensor {stored!r} has dtype {t.dtype}, expected {kinds[name]} tensor")
            elif not t.is_floating_point():
                raise CheckpointError(f"{f.name}: tensor {stored!r} has dtype {t.dtype}, expected a float type")
            if name == "t2d":
                t2d = t
            if param is None:
                continue
            dst, t = params[param], _heads(name, t, shard, cfg.layer.head_dim)
            start = next((o for s, o in offsets.items() if name.endswith(s)), 0)
            dst.narrow(0, start, t.shape[0]).copy_(t)
    _check_vocab_map(folder, model.d2t.cpu(), t2d, cfg)
    return model.eval()


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _read(path: Path, name: str) -> torch.Tensor:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return f.get_tensor(name)
    except read_errors() as e:
        raise CheckpointError(f"{path}: not a readable safetensors file at tensor {name!r} ({e})") from None


def _check_vocab_map(folder: Path, d2t: torch.Tensor, t2d: torch.Tensor, cfg: Eagle3Config) -> None:
    """``d2t`` must map the draft ids onto distinct target ids in range, the ones ``t2d`` marks."""
    target = torch.arange(d2t.shape[0]) + d2t
    vocab = cfg.layer.vocab_size
    if bool(((target < 0) | (target >= vocab)).any()):
        d = int(((target < 0) | (target >= vocab)).nonzero()[0])
        raise CheckpointError(f"{folder}: d2t maps draft id {d} to target id {int(target[d])}, outside [0, {vocab})")
    if torch.unique(target).numel() != target.numel() or not bool(t2d[target].all()) \
            or int(t2d.sum()) != target.numel():
        raise CheckpointError(f"{folder}: d2t and t2d disagree (d2t maps the draft ids onto {target.numel()} target "
                              f"ids, t2d marks {int(t2d.sum())}; expected the same distinct ids)")
