"""Where each tensor of a hybrid checkpoint lands on one rank (the Hub names, under
``model.`` or, in a multimodal checkpoint, ``model.language_model.``; its vision tower
and multi-token-prediction layers are skipped).

A linear layer's projections are fused into one ``in_proj`` of this rank's heads, rows
``[q | k | v | z | b | a]`` (Qwen3.5: ``in_proj_qkv`` gives three runs of rows under
attention TP, one of q, k and v each; ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` one
each) or ``[qkvz | ba]`` packed per key head (Qwen3-Next: a rank's key heads are one run
of ``in_proj_qkvz`` and of ``in_proj_ba``); the convolution's channels are q, k, v (three
runs under attention TP). A full layer's q_proj holds each head's query and output gate
(``[q | gate]`` a head): one run of rows per rank, fused with k and v. The MLPs as the
dense family's; a MoE layer's experts in either layout, its shared expert TP-sharded
and its gate whole.
"""

from __future__ import annotations

import math

import torch

from graphcp.model.config import ModelConfig
from graphcp.model.heads import HeadShard, head_shard
from graphcp.model.hybrid.config import FULL
from graphcp.model.tensor_table import TensorTarget, expert_targets, sharded_mlp
from graphcp.options import MoeLayout

#: tensors of a multimodal checkpoint that a text-only server does not run
SKIPPED = ("model.visual.", "mtp.")


def hybrid_tensors(cfg: ModelConfig, rank: int, tp: int, moe: MoeLayout = "ep",
                   shard: HeadShard | None = None) -> dict[str, TensorTarget]:
    """Checkpoint tensor -> where it lands on this rank (``rank``/``tp``: the FFN's TP
    rank and degree; ``shard``: this rank's attention heads)."""
    shard = shard or head_shard(cfg)
    P, H = cfg.hybrid.prefix, cfg.hidden_size
    t = {P + "embed_tokens.weight": TensorTarget("embed_tokens.weight", 0, 0, None, (cfg.vocab_size, H)),
         P + "norm.weight": TensorTarget("norm.weight", 0, 0, None, (H,))}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = TensorTarget("lm_head.weight", 0, 0, None, (cfg.vocab_size, H))
    for i in range(cfg.num_layers):
        hf, me = f"{P}layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"{hf}{norm}.weight"] = TensorTarget(f"{me}{norm}.weight", 0, 0, None, (H,))
        if cfg.hybrid.layer_kinds[i] == FULL:
            t.update(_attention(cfg, hf + "self_attn.", me + "self_attn.", shard))
        else:
            t.update(_linear(cfg, hf + "linear_attn.", me + "linear_attn.", shard))
        t.update(_mlp(cfg, i, hf + "mlp.", me + "mlp.", rank, tp, moe))
    return t


def _rows(param: str, at: int, start: int, count: int, shape: tuple[int, ...], whole: bool, dim: int = 0,
          **kw) -> TensorTarget:
    """Rows ``[start, start + count)`` of a checkpoint tensor (along ``dim``) at ``at`` of ``param``."""
    return TensorTarget(param, dim, at, None if whole else (dim, start, count), shape, **kw)


def _attention(cfg: ModelConfig, hf: str, me: str, s: HeadShard) -> dict[str, TensorTarget]:
    H, D, whole = cfg.hidden_size, cfg.head_dim, not s.split
    q, kv = 2 * cfg.num_heads * D, cfg.num_kv_heads * D  # (a query head's rows hold its gate too)
    nq, nk = 2 * s.num_heads * D, s.num_kv_heads * D
    out = {hf + "q_proj.weight": _rows(me + "qkv.weight", 0, 2 * s.q_start * D, nq, (q, H), whole),
           hf + "k_proj.weight": _rows(me + "qkv.weight", nq, s.kv_start * D, nk, (kv, H), whole),
           hf + "v_proj.weight": _rows(me + "qkv.weight", nq + nk, s.kv_start * D, nk, (kv, H), whole),
           hf + "o_proj.weight": _rows(me + "o_proj.weight", 0, s.q_start * D, nq // 2, (H, q // 2), whole, dim=1),
           hf + "q_norm.weight": TensorTarget(me + "q_norm.weight", 0, 0, None, (D,)),
           hf + "k_norm.weight": TensorTarget(me + "k_norm.weight", 0, 0, None, (D,))}
    if cfg.attention_bias:
        out[hf + "q_proj.bias"] = _rows(me + "qkv.bias", 0, 2 * s.q_start * D, nq, (q,), whole)
        out[hf + "k_proj.bias"] = _rows(me + "qkv.bias", nq, s.kv_start * D, nk, (kv,), whole)
        out[hf + "v_proj.bias"] = _rows(me + "qkv.bias", nq + nk, s.kv_start * D, nk, (kv,), whole)
        out[hf + "o_proj.bias"] = TensorTarget(me + "o_proj.bias", 0, 0, None, (H,))
    return out


def _qkv_runs(param: str, shape: tuple[int, ...], h, s: HeadShard) -> TensorTarget:
    """The q, k and v rows of this rank's heads (three runs of one tensor) at the start of ``param``."""
    k0, nk = s.rank * h.num_k_heads // s.size, h.num_k_heads // s.size
    dk, dv, r = h.k_head_dim, h.v_head_dim, h.group
    whole = not s.split
    q = _rows(param, 0, k0 * dk, nk * dk, shape, whole)
    if whole:
        return q
    k = _rows(param, nk * dk, h.num_k_heads * dk + k0 * dk, nk * dk, shape, False)
    v = _rows(param, 2 * nk * dk, 2 * h.num_k_heads * dk + k0 * r * dv, nk * r * dv, shape, False)
    return TensorTarget(q.param, 0, 0, q.shard, shape, parts=(k, v))


def _linear(cfg: ModelConfig, hf: str, me: str, s: HeadShard) -> dict[str, TensorTarget]:
    h, H = cfg.hybrid, cfg.hidden_size
    whole, A = not s.split, s.size
    k0, nk = s.rank * h.num_k_heads // A, h.num_k_heads // A
    v0, nv = k0 * h.group, nk * h.group
    dv, K, conv = h.v_head_dim, h.conv_kernel, h.conv_dim
    local_conv = conv // A
    out = {hf + "conv1d.weight": _qkv_runs(me + "conv1d", (conv, 1, K), h, s),
           hf + "dt_bias": _rows(me + "dt_bias", 0, v0, nv, (h.num_v_heads,), whole, float32=True),
           hf + "A_log": _rows(me + "a_log", 0, v0, nv, (h.num_v_heads,), whole, float32=True),
           hf + "norm.weight": TensorTarget(me + "norm", 0, 0, None, (dv,)),
           hf + "out_proj.weight": _rows(me + "out_proj.weight", 0, v0 * dv, nv * dv, (H, h.num_v_heads * dv), whole,
                                         dim=1)}
    proj = me + "in_proj.weight"
    if h.packed:
        width = 2 * h.k_head_dim + 2 * h.group * dv
        out[hf + "in_proj_qkvz.weight"] = _rows(proj, 0, k0 * width, nk * width, (h.num_k_heads * width, H), whole)
        out[hf + "in_proj_ba.weight"] = _rows(proj, nk * width, k0 * 2 * h.group, nk * 2 * h.group,
                                              (2 * h.num_v_heads, H), whole)
        return out
    out[hf + "in_proj_qkv.weight"] = _qkv_runs(proj, (conv, H), h, s)
    out[hf + "in_proj_z.weight"] = _rows(proj, local_conv, v0 * dv, nv * dv, (h.num_v_heads * dv, H), whole)
    out[hf + "in_proj_b.weight"] = _rows(proj, local_conv + nv * dv, v0, nv, (h.num_v_heads, H), whole)
    out[hf + "in_proj_a.weight"] = _rows(proj, local_conv + nv * dv + nv, v0, nv, (h.num_v_heads, H), whole)
    return out


def _mlp(cfg: ModelConfig, i: int, hf: str, me: str, rank: int, tp: int, moe: MoeLayout) -> dict[str, TensorTarget]:
    H, m = cfg.hidden_size, cfg.moe
    if m is None or not m.is_sparse(i):
        return sharded_mlp(hf, me, cfg.intermediate_size, H, rank, tp)
    out = {hf + "gate.weight": TensorTarget(me + "router.weight", 0, 0, None, (m.num_experts, H)),
           hf + "shared_expert_gate.weight": TensorTarget(me + "shared.gate", 0, 0, None, (1, H))}
    out.update(expert_targets(hf + "experts.", me + "experts.", m.num_experts, m.intermediate_size, H, rank, tp, moe))
    out.update(sharded_mlp(hf + "shared_expert.", me + "shared.", m.shared_intermediate_size, H, rank, tp))
    return out


def is_skipped(name: str) -> bool:
    return name.startswith(SKIPPED)


def random_weights(cfg: ModelConfig, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Seeded Hub-named tensors of every shape the table lists (matrices std 0.02, the
    zero-centred norms near 0, the gated norm near 1, decays as transformers initialises them)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tgt in hybrid_tensors(cfg, 0, 1, "tp").items():
        shape = tgt.shape
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1, 16, generator=g).log()
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif "norm" in name:
            t = 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * (0.02 if len(shape) > 1 else 0.1)
            if name.endswith("conv1d.weight"):
                t = t * math.sqrt(50.0)  # a convolution of K taps: weights of order 1 / sqrt(K)
        out[name] = t.to(dtype)
    return out
