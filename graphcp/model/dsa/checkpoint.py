"""Where each tensor of a DSA checkpoint (the Hugging Face Hub layout, as transformers
saves it) lands in :class:`~graphcp.model.dsa.model.DsaModel` on one rank.

Whole on every rank: embeddings, norms, the LM head, every attention and indexer
weight, the MoE routers. Tensor-parallel shards: the dense MLP's and the shared
experts' gate/up rows and down columns. Routed experts (one tensor per expert per
projection: ``mlp.experts.{e}.gate_proj.weight``): with ``--moe tp`` each expert's
shard on every rank; with ``--moe ep`` a rank reads its ``E / C`` experts whole and
only checks the shapes of the others'. The routers' weight and
``e_score_correction_bias`` are float32 in every checkpoint (transformers keeps them
so). Tensors of layers past ``num_hidden_layers`` (the multi-token-prediction layer
DeepSeek and GLM ship) are not used for prefill and are skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from graphcp.config import DTYPES
from graphcp.model.config import ModelConfig
from graphcp.options import MoeLayout

#: a decoder layer's tensor, for telling the MTP layers (index >= num_hidden_layers) apart
LAYER = re.compile(r"model\.layers\.(\d+)\.")
#: DeepSeek V4's multi-token-prediction tensors (transformers skips them too)
MTP = "mtp."


@dataclass(frozen=True)
class TensorTarget:
    param: str  # our parameter name
    dim: int  # the parameter dim the slice runs along
    start: int  # where the slice lands along it
    shard: tuple[int, int, int] | None  # (dim, start, length) read from the checkpoint tensor; None: whole
    shape: tuple[int, ...]  # the checkpoint tensor's full shape
    float32: bool = False  # stored in float32 whatever the checkpoint's dtype
    index: int | None = None  # lands in ``param[index]`` (a local expert), then as above
    read: bool = True  # False: another rank's expert (its shape is checked, it is not read)
    integer: bool = False  # an integer table (DeepSeek V4's tid2eid), not a weight


def is_skipped(name: str, num_layers: int) -> bool:
    """A tensor of a layer graphcp does not run: multi-token prediction, as DeepSeek V3.2
    and GLM-5 ship it (layers past ``num_hidden_layers``) and DeepSeek V4 (``mtp.*``)."""
    hit = LAYER.match(name)
    return (hit is not None and int(hit.group(1)) >= num_layers) or name.startswith(MTP)


def dsa_tensors(cfg: ModelConfig, rank: int, tp: int, moe: MoeLayout = "tp") -> dict[str, TensorTarget]:
    d, h = cfg.dsa, cfg.hidden_size
    t: dict[str, TensorTarget] = {}

    def whole(name: str, param: str, *shape: int, float32: bool = False) -> None:
        t[name] = TensorTarget(param, 0, 0, None, shape, float32)

    def mlp(hf: str, me: str, size: int) -> None:
        t.update(sharded_mlp(hf, me, size, h, rank, tp))

    whole("model.embed_tokens.weight", "embed_tokens.weight", cfg.vocab_size, h)
    whole("model.norm.weight", "norm.weight", h)
    if not cfg.tie_word_embeddings:
        whole("lm_head.weight", "lm_head.weight", cfg.vocab_size, h)
    heads = cfg.num_heads
    for i in range(cfg.num_layers):
        hf, me = f"model.layers.{i}.", f"layers.{i}."
        whole(hf + "input_layernorm.weight", me + "input_layernorm.weight", h)
        whole(hf + "post_attention_layernorm.weight", me + "post_attention_layernorm.weight", h)
        a, m = hf + "self_attn.", me + "self_attn."
        for name, shape in (("q_a_proj.weight", (d.q_lora_rank, h)), ("q_a_layernorm.weight", (d.q_lora_rank,)),
                            ("q_b_proj.weight", (heads * d.qk_head_dim, d.q_lora_rank)),
                            ("kv_a_proj_with_mqa.weight", (d.latent_dim, h)),
                            ("kv_a_layernorm.weight", (d.kv_lora_rank,)),
                            ("kv_b_proj.weight", (heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank)),
                            ("o_proj.weight", (h, heads * d.v_head_dim))):
            whole(a + name, m + name, *shape)
        if cfg.attention_bias:
            whole(a + "q_a_proj.bias", m + "q_a_proj.bias", d.q_lora_rank)
            whole(a + "kv_a_proj_with_mqa.bias", m + "kv_a_proj_with_mqa.bias", d.latent_dim)
        if cfg.o_bias:
            whole(a + "o_proj.bias", m + "o_proj.bias", h)
        if d.indexer_layers[i]:
            for name, shape in (("wq_b.weight", (d.index_n_heads * d.index_head_dim, d.q_lora_rank)),
                                ("wk.weight", (d.index_head_dim, h)), ("k_norm.weight", (d.index_head_dim,)),
                                ("k_norm.bias", (d.index_head_dim,)), ("weights_proj.weight", (d.index_n_heads, h))):
                whole(a + "indexer." + name, m + "indexer." + name, *shape)
        if not d.is_moe(i):
            mlp(hf + "mlp.", me + "mlp.", cfg.intermediate_size)
            continue
        m = d.moe
        whole(hf + "mlp.gate.weight", me + "mlp.router.weight", m.num_experts, h, float32=True)
        whole(hf + "mlp.gate.e_score_correction_bias", me + "mlp.router.e_score_correction_bias", m.num_experts,
              float32=True)
        if m.shared_intermediate_size:
            mlp(hf + "mlp.shared_experts.", me + "mlp.shared.", m.shared_intermediate_size)
        t.update(expert_targets(f"{hf}mlp.experts.", me + "mlp.experts.", m.num_experts, m.intermediate_size, h,
                                 rank, tp, moe))
    return t


def expert_targets(hf: str, me: str, num_experts: int, size: int, h: int, rank: int, tp: int,
                    moe: MoeLayout, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                    ) -> dict[str, TensorTarget]:
    """The routed experts' tensors into SparseMoeBlock's stacked ``gate_up [E_local, 2 I,
    h]`` / ``down [E_local, h, I]``: ``ep``: this rank's experts whole (the others'
    checked, not read); ``tp``: each expert's ``I / C`` slice."""
    t = {}
    gate_up, down = me + "gate_up", me + "down"
    g, u, d = names
    if moe == "ep":
        local = num_experts // tp
        for e in range(num_experts):
            mine, i = e // local == rank, e % local
            t[f"{hf}{e}.{g}.weight"] = TensorTarget(gate_up, 0, 0, None, (size, h), index=i, read=mine)
            t[f"{hf}{e}.{u}.weight"] = TensorTarget(gate_up, 0, size, None, (size, h), index=i, read=mine)
            t[f"{hf}{e}.{d}.weight"] = TensorTarget(down, 0, 0, None, (h, size), index=i, read=mine)
        return t
    s = size // tp
    rows = (0, rank * s, s)
    for e in range(num_experts):
        t[f"{hf}{e}.{g}.weight"] = TensorTarget(gate_up, 0, 0, rows, (size, h), index=e)
        t[f"{hf}{e}.{u}.weight"] = TensorTarget(gate_up, 0, s, rows, (size, h), index=e)
        t[f"{hf}{e}.{d}.weight"] = TensorTarget(down, 1, 0, (1, rank * s, s), (h, size), index=e)
    return t


def sharded_mlp(hf: str, me: str, size: int, h: int, rank: int, tp: int,
                names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict[str, TensorTarget]:
    """A SwiGLU MLP of ``size`` sharded over tp ranks (ParallelMLP's fused gate_up, down)."""
    s = size // tp
    rows = (0, rank * s, s)
    g, u, d = names
    return {hf + f"{g}.weight": TensorTarget(me + "gate_up.weight", 0, 0, rows, (size, h)),
            hf + f"{u}.weight": TensorTarget(me + "gate_up.weight", 0, s, rows, (size, h)),
            hf + f"{d}.weight": TensorTarget(me + "down.weight", 1, 0, (1, rank * s, s), (h, size))}


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded Hub-named tensors of every shape the table lists (the presets' writer):
    matrices std fan_in ** -0.5 (indexer scores and router logits of order 1: with
    small weights they crowd together and a float32 rounding flips a top-k choice),
    norms near 1, biases near 0; routers in float32 as transformers keeps them."""
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[cfg.torch_dtype or "float32"]
    out = {}
    for name, t in dsa_tensors(cfg, 0, 1).items():
        noise = torch.randn(t.shape, generator=g)
        if len(t.shape) == 2:
            w = noise * t.shape[1] ** -0.5
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            w = 1.0 + 0.1 * noise
        else:  # biases (the indexer's LayerNorm, the router's correction)
            w = 0.02 * noise
        out[name] = w if t.float32 else w.to(dtype)
    return out
