"""Where each tensor of a dense (or MoE) decoder checkpoint lands on one rank.

Each rank reads only what it keeps: attention weights of its heads, the MLP's gate/up
rows and down columns of its TP shard; q/k/v are fused into one projection and gate/up
into one, so every checkpoint tensor maps to a slice of one parameter.

Mixture-of-experts layers (Hub format: one tensor per expert per projection, as
transformers saves them; Qwen3-MoE ``mlp.experts.{e}.gate_proj``/``up_proj``/
``down_proj``, Mixtral ``block_sparse_moe.experts.{e}.w1``/``w3``/``w2``): the router
whole; with ``moe="ep"`` only this rank's experts, whole (the others' tensors are
checked for shape, never read); with ``moe="tp"`` every expert's TP shard.
"""

from __future__ import annotations

import re

import torch

from graphcp.model.config import ModelConfig
from graphcp.model.heads import HeadShard, head_shard
from graphcp.model.moe_config import MOE_NAMES, moe_from_hf
from graphcp.model.tensor_table import TensorTarget
from graphcp.options import MoeLayout

#: an expert's tensor: model.layers.{layer}.{mlp|block_sparse_moe}.experts.{expert}.{projection}.weight
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")


def dense_tensors(cfg: ModelConfig, rank: int, tp: int, moe: MoeLayout = "ep",
                  shard: HeadShard | None = None) -> dict[str, TensorTarget]:
    """Checkpoint tensor -> where it lands (``read=False``: another rank's expert, checked
    not read). ``rank``/``tp``: the FFN's TP rank and degree; ``shard``: this rank's heads."""
    t = _targets(cfg, rank, tp, moe, shard)
    return {name: TensorTarget(**tgt, shape=_expected_shape(cfg, name)) if tgt is not None
            else TensorTarget("", 0, 0, None, _expected_shape(cfg, name), read=False) for name, tgt in t.items()}


def _targets(cfg: ModelConfig, rank: int, tp: int, moe: MoeLayout, shard: HeadShard | None) -> dict:
    """name -> (param, dim, start, shard) with an optional index, or None (another rank's expert)."""
    heads = shard or head_shard(cfg)

    def at(param: str, dim: int, start: int, rows=None, index=None) -> dict:
        return dict(param=param, dim=dim, start=start, shard=rows, index=index)

    t: dict = {"model.embed_tokens.weight": at("embed_tokens.weight", 0, 0),
               "model.norm.weight": at("norm.weight", 0, 0)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = at("lm_head.weight", 0, 0)
    size = cfg.intermediate_size // tp
    for i in range(cfg.num_layers):
        hf, me = f"model.layers.{i}.", f"layers.{i}."
        t[hf + "input_layernorm.weight"] = at(me + "input_layernorm.weight", 0, 0)
        t[hf + "post_attention_layernorm.weight"] = at(me + "post_attention_layernorm.weight", 0, 0)
        for name, off, rows in _qkv_slices(cfg, heads):
            t[hf + f"self_attn.{name}.weight"] = at(me + "self_attn.qkv.weight", 0, off, rows)
            if cfg.attention_bias:
                t[hf + f"self_attn.{name}.bias"] = at(me + "self_attn.qkv.bias", 0, off, rows)
        o_cols = None if not heads.split else (1, heads.q_start * cfg.head_dim, heads.num_heads * cfg.head_dim)
        t[hf + "self_attn.o_proj.weight"] = at(me + "self_attn.o_proj.weight", 1, 0, o_cols)
        if cfg.o_bias:
            t[hf + "self_attn.o_proj.bias"] = at(me + "self_attn.o_proj.bias", 0, 0)
        if cfg.qk_norm:
            t[hf + "self_attn.q_norm.weight"] = at(me + "self_attn.q_norm.weight", 0, 0)
            t[hf + "self_attn.k_norm.weight"] = at(me + "self_attn.k_norm.weight", 0, 0)
        if cfg.moe is not None and cfg.moe.is_sparse(i):
            t.update(_moe_targets(cfg, i, rank, tp, moe, at))
            continue
        rows = (0, rank * size, size)
        t[hf + "mlp.gate_proj.weight"] = at(me + "mlp.gate_up.weight", 0, 0, rows)
        t[hf + "mlp.up_proj.weight"] = at(me + "mlp.gate_up.weight", 0, size, rows)
        t[hf + "mlp.down_proj.weight"] = at(me + "mlp.down.weight", 1, 0, (1, rank * size, size))
        if cfg.mlp_bias:
            t[hf + "mlp.gate_proj.bias"] = at(me + "mlp.gate_up.bias", 0, 0, rows)
            t[hf + "mlp.up_proj.bias"] = at(me + "mlp.gate_up.bias", 0, size, rows)
            t[hf + "mlp.down_proj.bias"] = at(me + "mlp.down_bias", 0, 0)
    return t


def _qkv_slices(cfg: ModelConfig, shard: HeadShard) -> list[tuple[str, int, tuple[int, int, int] | None]]:
    """q/k/v: (name, offset in the fused projection, rows read: this rank's heads, or all)."""
    d = cfg.head_dim
    q, kv = shard.num_heads * d, shard.num_kv_heads * d
    if not shard.split:
        return [("q_proj", 0, None), ("k_proj", q, None), ("v_proj", q + kv, None)]
    k_rows = (0, shard.kv_start * d, kv)
    return [("q_proj", 0, (0, shard.q_start * d, q)), ("k_proj", q, k_rows), ("v_proj", q + kv, k_rows)]


def _moe_targets(cfg: ModelConfig, i: int, rank: int, tp: int, moe: MoeLayout, at) -> dict:
    """One sparse layer's router and experts (see the module doc)."""
    m = cfg.moe
    module, (gate, up, down) = MOE_NAMES[cfg.family]
    hf, me = f"model.layers.{i}.{module}.", f"layers.{i}.mlp."
    t: dict = {hf + "gate.weight": at(me + "router.weight", 0, 0)}
    if moe == "ep":
        local = m.num_experts // tp
        for e in range(m.num_experts):
            mine, k = e // local == rank, e % local
            t[hf + f"experts.{e}.{gate}.weight"] = at(me + "experts.gate_up", 0, 0, None, k) if mine else None
            t[hf + f"experts.{e}.{up}.weight"] = (at(me + "experts.gate_up", 0, m.intermediate_size, None, k)
                                                  if mine else None)
            t[hf + f"experts.{e}.{down}.weight"] = at(me + "experts.down", 0, 0, None, k) if mine else None
        return t
    size = m.intermediate_size // tp
    rows = (0, rank * size, size)
    for e in range(m.num_experts):
        t[hf + f"experts.{e}.{gate}.weight"] = at(me + "experts.gate_up", 0, 0, rows, e)
        t[hf + f"experts.{e}.{up}.weight"] = at(me + "experts.gate_up", 0, size, rows, e)
        t[hf + f"experts.{e}.{down}.weight"] = at(me + "experts.down", 1, 0, (1, rank * size, size), e)
    return t


def unexpected_hint(cfg: ModelConfig, name: str) -> str:
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


#: a layer's matrices: std GAIN / sqrt(fan-in), so each attention and MLP block adds about
#: half its input's size to the residual stream and the token's own embedding stays a large
#: part of it (with std 0.02 everywhere the attention's running average of the context,
#: nearly alike at every position, swamped the token: every position predicted one token,
#: and greedy text repeated it)
GAIN = 0.7


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF-named tensors for a config.json of this family (Qwen3-MoE and Mixtral too:
    router and per-expert tensors in the Hub layout), seeded, whose greedy text varies: the
    layers' matrices std ``GAIN / sqrt(fan-in)``, norms near 1, the embeddings and an untied
    LM head as :func:`_embedding_std` and :func:`_head_std` say."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or h // heads
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.get("torch_dtype", "float32")]
    qwen3 = config["model_type"] in ("qwen3", "qwen3_moe")
    tied = config.get("tie_word_embeddings", False)
    moe = moe_from_hf(config, config["model_type"], config["num_hidden_layers"], "preset")

    def rnd(rows, cols, std=None):
        std = GAIN * cols ** -0.5 if std is None else std
        return (torch.randn(rows, cols, generator=g) * std).to(dtype)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    w = {"model.embed_tokens.weight": rnd(v, h, _embedding_std(h, tied)), "model.norm.weight": norm(h)}
    if not tied:
        w["lm_head.weight"] = rnd(v, h, _head_std(h))
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = rnd(heads * d, h)
        w[p + "self_attn.k_proj.weight"] = rnd(kv * d, h)
        w[p + "self_attn.v_proj.weight"] = rnd(kv * d, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, heads * d)
        if qwen3:
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
        if moe is not None and moe.is_sparse(layer):
            module, (gate, up, down) = MOE_NAMES[config["model_type"]]
            w[p + f"{module}.gate.weight"] = rnd(moe.num_experts, h)
            for e in range(moe.num_experts):
                w[p + f"{module}.experts.{e}.{gate}.weight"] = rnd(moe.intermediate_size, h)
                w[p + f"{module}.experts.{e}.{up}.weight"] = rnd(moe.intermediate_size, h)
                w[p + f"{module}.experts.{e}.{down}.weight"] = rnd(h, moe.intermediate_size)
            continue
        w[p + "mlp.gate_proj.weight"] = rnd(i, h)
        w[p + "mlp.up_proj.weight"] = rnd(i, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, i)
    return w


def _embedding_std(hidden: int, tied: bool) -> float:
    """1 (a token's own vector, the residual stream's largest part, cheap in bfloat16: it
    goes through no layer), unless the LM head is the embedding matrix: then a token's own
    vector would make it predict itself, so the rows are an LM head's size."""
    return _head_std(hidden) if tied else 1.0


def _head_std(hidden: int) -> float:
    """The LM head's rows: logits of order 1 from the final norm's output."""
    return hidden ** -0.5
