"""Where each tensor of a DeepSeek V4 checkpoint (the Hub layout transformers saves:
DeepSeek's own names, ``model.layers.{i}.attn.wq_a.weight``, ``ffn.experts.{e}.w1``, ...)
lands in :class:`~graphcp.model.dsv4.model.DsV4Model` on one rank.

Whole on every rank: embeddings, norms, the mHC weights, the LM head, every attention,
compressor and indexer weight, the routers (and a hash layer's ``tid2eid``, int64).
Tensor-parallel shards: the shared expert's w1/w3 rows and w2 columns. Routed experts
as :func:`graphcp.model.dsa.checkpoint.expert_targets` places them (``--moe ep|tp``).
Float32 in every checkpoint (transformers keeps them so): norms, mHC, sinks,
``position_bias`` (``ape``) and the router's correction bias.
"""

from __future__ import annotations

import torch

from graphcp.config import DTYPES
from graphcp.model.config import ModelConfig
from graphcp.model.dsv4.cache import CSA, HCA
from graphcp.model.heads import HeadShard, head_shard
from graphcp.model.tensor_table import TensorTarget, expert_targets, sharded_mlp
from graphcp.options import MoeLayout

EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


def dsv4_tensors(cfg: ModelConfig, rank: int, tp: int, moe: MoeLayout = "tp",
                 shard: HeadShard | None = None) -> dict[str, TensorTarget]:
    """``shard``: this rank's query heads under attention TP (None: all): its rows of
    ``wq_b``, its sinks, its head groups' rows of ``wo_a`` and columns of ``wo_b``."""
    d, h, H = cfg.dsv4, cfg.hidden_size, cfg.num_heads
    hd, n = d.head_dim, d.hc_mult
    t: dict[str, TensorTarget] = {}
    shard = shard or head_shard(cfg)
    hl, q0 = shard.num_heads, shard.q_start  # this rank's heads
    g_len = d.o_groups * hl // H  # its head groups' o_lora rows (o_groups divides by attention TP)
    lora_rows = (0, q0 * d.o_groups // H * d.o_lora_rank, g_len * d.o_lora_rank)

    def whole(name: str, param: str, *shape: int, float32: bool = False, integer: bool = False) -> None:
        t[name] = TensorTarget(param, 0, 0, None, shape, float32, integer=integer)

    def hc(hf: str, me: str, width: int) -> None:
        for a, b, shape in (("fn", "fn", (width, n * h)), ("base", "base", (width,)), ("scale", "scale", (3,))):
            whole(f"{hf}_{a}", f"{me}.{b}", *shape, float32=True)

    whole("model.embed_tokens.weight", "embed_tokens.weight", cfg.vocab_size, h)
    whole("model.norm.weight", "norm.weight", h, float32=True)
    if not cfg.tie_word_embeddings:
        whole("head.weight", "lm_head.weight", cfg.vocab_size, h)
    whole("model.hc_head.hc_fn", "hc_head.hc_fn", n, n * h, float32=True)
    whole("model.hc_head.hc_base", "hc_head.hc_base", n, float32=True)
    whole("model.hc_head.hc_scale", "hc_head.hc_scale", 1, float32=True)
    for i in range(cfg.num_layers):
        hf, me = f"model.layers.{i}.", f"layers.{i}."
        whole(hf + "attn_norm.weight", me + "input_layernorm.weight", h, float32=True)
        whole(hf + "ffn_norm.weight", me + "post_attention_layernorm.weight", h, float32=True)
        hc(hf + "hc_attn", me + "attn_hc", (2 + n) * n)
        hc(hf + "hc_ffn", me + "ffn_hc", (2 + n) * n)
        a, m = hf + "attn.", me + "self_attn."
        for name, param, shape, f32 in (
                ("wq_a.weight", "q_a_proj.weight", (d.q_lora_rank, h), False),
                ("q_norm.weight", "q_a_norm.weight", (d.q_lora_rank,), True),
                ("wkv.weight", "kv_proj.weight", (hd, h), False),
                ("norm.weight", "kv_norm.weight", (hd,), True)):
            whole(a + name, m + param, *shape, float32=f32)
        # this rank's heads (all of them at attention TP 1)
        t[a + "wq_b.weight"] = TensorTarget(m + "q_b_proj.weight", 0, 0, (0, q0 * hd, hl * hd), (H * hd, d.q_lora_rank))
        t[a + "attn_sink"] = TensorTarget(m + "sinks", 0, 0, (0, q0, hl), (H,), True)
        t[a + "wo_a.weight"] = TensorTarget(m + "o_a_proj.weight", 0, 0, lora_rows,
                                            (d.o_groups * d.o_lora_rank, H * hd // d.o_groups))
        t[a + "wo_b.weight"] = TensorTarget(m + "o_b_proj.weight", 1, 0, (1, *lora_rows[1:]),
                                            (h, d.o_groups * d.o_lora_rank))
        kind = d.layer_kinds[i]
        series = [("compressor.", "compressor.", hd, 2 if kind == CSA else 1)] if kind in (CSA, HCA) else []
        if kind == CSA:
            series.append(("indexer.compressor.", "indexer.", d.index_head_dim, 2))
            whole(a + "indexer.wq_b.weight", m + "index_q_proj.weight", d.index_n_heads * d.index_head_dim,
                  d.q_lora_rank)
            whole(a + "indexer.weights_proj.weight", m + "index_weights_proj.weight", d.index_n_heads, h)
        for src, dst, width, k in series:
            rate = d.compress_csa if kind == CSA else d.compress_hca
            whole(a + src + "wkv.weight", m + dst + "kv_proj.weight", k * width, h)
            whole(a + src + "wgate.weight", m + dst + "gate_proj.weight", k * width, h)
            whole(a + src + "ape", m + dst + "position_bias", rate, k * width, float32=True)
            whole(a + src + "norm.weight", m + dst + "kv_norm.weight", width, float32=True)
        whole(hf + "ffn.gate.weight", me + "mlp.router.weight", d.num_experts, h)
        if d.hash_layers[i]:
            whole(hf + "ffn.gate.tid2eid", me + "mlp.router.tid2eid", cfg.vocab_size, d.top_k, integer=True)
        else:
            whole(hf + "ffn.gate.bias", me + "mlp.router.e_score_correction_bias", d.num_experts, float32=True)
        t.update(sharded_mlp(hf + "ffn.shared_experts.", me + "mlp.shared.", d.moe_intermediate_size, h, rank, tp,
                             EXPERT_NAMES))
        t.update(expert_targets(hf + "ffn.experts.", me + "mlp.experts.", d.num_experts, d.moe_intermediate_size, h,
                                 rank, tp, moe, EXPERT_NAMES))
    return t


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded Hub-named tensors of every shape the table lists (the preset writer):
    matrices std fan_in ** -0.5, mHC projections small (its Sinkhorn weights stay near
    uniform), norms near 1, biases and sinks small; ``tid2eid`` distinct experts a token."""
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[cfg.torch_dtype or "float32"]
    d = cfg.dsv4
    out = {}
    for name, t in dsv4_tensors(cfg, 0, 1).items():
        if t.integer:
            out[name] = torch.stack([torch.randperm(d.num_experts, generator=g)[: d.top_k]
                                     for _ in range(t.shape[0])])
            continue
        noise = torch.randn(t.shape, generator=g)
        if name.endswith("_fn") or name.endswith("hc_fn"):
            w = 0.02 * noise
        elif len(t.shape) == 2 and not name.endswith("ape"):
            w = noise * t.shape[1] ** -0.5
        elif name.endswith("norm.weight") or name.endswith("_scale"):
            w = 1.0 + 0.1 * noise
        else:  # biases, sinks, position biases
            w = 0.1 * noise
        out[name] = w if t.float32 else w.to(dtype)
    return out
