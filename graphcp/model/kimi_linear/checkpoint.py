"""Where each tensor of a Kimi Linear checkpoint lands on one rank, in either of the two
spellings such checkpoints come in (and the parts GLM-5-Next's table shares):

- the *original* names, which transformers' ``save_pretrained`` writes (and the Hub's
  checkpoints use): a KDA layer's ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, its
  ``f_a_proj`` / ``f_b_proj`` / ``dt_bias`` / ``A_log`` beside the projections, every
  layer's MLP under ``block_sparse_moe.`` (the dense ones' too) with one tensor per
  expert (``experts.N.w1`` gate, ``w3`` up, ``w2`` down);
- transformers' *in-memory* names (a state dict saved as it is): ``conv1d`` (q, k, v
  stacked), the gate under ``forget_gate.``, the MoE under ``mlp.`` with the experts
  merged (``experts.gate_up_proj`` ``[E, 2 I, hidden]``, ``experts.down_proj`` ``[E,
  hidden, I]``).

:func:`spelling` tells them apart by the names a checkpoint lists. A KDA layer's
projections are fused into one ``in_proj`` (rows ``[q | k | v | f_a | g_a | b]``) and its
convolution into one ``[3 H d, 1, K]`` weight; an MLA layer's tensors are whole on every
rank; the dense MLP and the shared expert TP-sharded, the experts in either MoE layout.
"""

from __future__ import annotations

import torch

from graphcp.config import DTYPES
from graphcp.model.config import ModelConfig
from graphcp.model.kimi_linear.config import KdaConfig, KimiConfig, LatentConfig, kimi_a_log
from graphcp.model.moe_config import MoeConfig
from graphcp.model.tensor_table import TensorTarget, expert_targets, sharded_mlp
from graphcp.options import MoeLayout

ORIGINAL, IN_MEMORY = "original", "in-memory"
#: names only transformers' in-memory spelling has
IN_MEMORY_MARKS = (".forget_gate.", ".self_attn.conv1d.", ".experts.gate_up_proj", ".attn_hc.")


def spelling(names) -> str:
    """Which spelling a checkpoint listing ``names`` uses."""
    return IN_MEMORY if any(m in n for n in names for m in IN_MEMORY_MARKS) else ORIGINAL


def whole(param: str, *shape: int, float32: bool = False) -> TensorTarget:
    return TensorTarget(param, 0, 0, None, shape, float32)


def rows_at(param: str, start: int, *shape: int, float32: bool = False) -> TensorTarget:
    """A whole checkpoint tensor landing at row ``start`` of ``param``."""
    return TensorTarget(param, 0, start, None, shape, float32)


def kda_targets(hf: str, me: str, kda: KdaConfig, hidden: int, a_log_shape: tuple[int, ...],
                how: str) -> dict[str, TensorTarget]:
    """A KDA layer (``hf``: its ``self_attn.`` prefix) into graphcp's KdaAttention (``me``)."""
    H, D, K = kda.num_heads, kda.head_dim, kda.conv_kernel
    HD, c, f32 = kda.qkv_dim, kda.conv_dim, kda.conv_float32
    gate = "forget_gate." if how == IN_MEMORY else ""
    proj = me + "in_proj.weight"
    t = {hf + "q_proj.weight": rows_at(proj, 0, HD, hidden), hf + "k_proj.weight": rows_at(proj, HD, HD, hidden),
         hf + "v_proj.weight": rows_at(proj, 2 * HD, HD, hidden),
         hf + gate + "f_a_proj.weight": rows_at(proj, c, D, hidden),
         hf + "g_a_proj.weight": rows_at(proj, c + D, D, hidden),
         hf + "b_proj.weight": rows_at(proj, c + 2 * D, H, hidden),
         hf + gate + "f_b_proj.weight": whole(me + "f_b_proj.weight", HD, D),
         hf + "g_b_proj.weight": whole(me + "g_b_proj.weight", HD, D),
         hf + gate + "dt_bias": whole(me + "dt_bias", HD, float32=True),
         hf + gate + "A_log": whole(me + "a_log", *a_log_shape, float32=True),
         hf + "o_norm.weight": whole(me + "o_norm", D), hf + "o_proj.weight": whole(me + "o_proj.weight", hidden, HD)}
    if how == IN_MEMORY:
        t[hf + "conv1d.weight"] = whole(me + "conv1d", c, 1, K, float32=f32)
    else:
        for j, name in enumerate("qkv"):
            t[f"{hf}{name}_conv1d.weight"] = rows_at(me + "conv1d", j * HD, HD, 1, K, float32=f32)
    return t


def latent_targets(hf: str, me: str, m: LatentConfig, hidden: int, heads: int, bias: bool) -> dict[str, TensorTarget]:
    """An MLA layer's tensors (``hf``: its ``self_attn.`` prefix), whole on every rank."""
    t = {}
    if m.q_lora_rank is None:
        t[hf + "q_proj.weight"] = whole(me + "q_proj.weight", heads * m.qk_head_dim, hidden)
    else:
        t[hf + "q_a_proj.weight"] = whole(me + "q_a_proj.weight", m.q_lora_rank, hidden)
        t[hf + "q_a_layernorm.weight"] = whole(me + "q_a_layernorm.weight", m.q_lora_rank)
        t[hf + "q_b_proj.weight"] = whole(me + "q_b_proj.weight", heads * m.qk_head_dim, m.q_lora_rank)
        if bias:
            t[hf + "q_a_proj.bias"] = whole(me + "q_a_proj.bias", m.q_lora_rank)
    t[hf + "kv_a_proj_with_mqa.weight"] = whole(me + "kv_a_proj_with_mqa.weight", m.latent_dim, hidden)
    t[hf + "kv_a_layernorm.weight"] = whole(me + "kv_a_layernorm.weight", m.kv_lora_rank)
    t[hf + "kv_b_proj.weight"] = whole(me + "kv_b_proj.weight", heads * (m.qk_nope_head_dim + m.v_head_dim),
                                       m.kv_lora_rank)
    t[hf + "o_proj.weight"] = whole(me + "o_proj.weight", hidden, heads * m.v_head_dim)
    if bias:
        t[hf + "kv_a_proj_with_mqa.bias"] = whole(me + "kv_a_proj_with_mqa.bias", m.latent_dim)
        t[hf + "o_proj.bias"] = whole(me + "o_proj.bias", hidden)
    return t


def merged_experts(hf: str, me: str, moe: MoeConfig, hidden: int, rank: int, tp: int,
                   layout: MoeLayout) -> dict[str, TensorTarget]:
    """transformers' merged experts (``gate_up_proj`` ``[E, 2 I, hidden]``, ``down_proj``
    ``[E, hidden, I]``) into SparseMoeBlock's: ``ep``: this rank's experts; ``tp``: every
    expert's ``I / T`` slice of the gate rows, the up rows and the down columns."""
    E, size = moe.num_experts, moe.intermediate_size
    gate_up, down = (E, 2 * size, hidden), (E, hidden, size)
    if layout == "ep":
        local = E // tp
        rows = (0, rank * local, local)
        return {hf + "gate_up_proj": TensorTarget(me + "gate_up", 0, 0, rows, gate_up),
                hf + "down_proj": TensorTarget(me + "down", 0, 0, rows, down)}
    s = size // tp
    up = TensorTarget(me + "gate_up", 1, s, (1, size + rank * s, s), gate_up)
    return {hf + "gate_up_proj": TensorTarget(me + "gate_up", 1, 0, (1, rank * s, s), gate_up, parts=(up,)),
            hf + "down_proj": TensorTarget(me + "down", 2, 0, (2, rank * s, s), down)}


def moe_targets(hf: str, me: str, moe: MoeConfig, hidden: int, rank: int, tp: int, layout: MoeLayout, how: str,
                names: tuple[str, str, str]) -> dict[str, TensorTarget]:
    """DeepSeek's MoE (``hf``: its module prefix): the float32 router and correction bias,
    the TP-sharded shared expert, the experts (``names``: the original spelling's gate,
    up and down per expert)."""
    E = moe.num_experts
    t = {hf + "gate.weight": whole(me + "router.weight", E, hidden, float32=True),
         hf + "gate.e_score_correction_bias": whole(me + "router.e_score_correction_bias", E, float32=True)}
    if moe.shared_intermediate_size:
        t.update(sharded_mlp(hf + "shared_experts.", me + "shared.", moe.shared_intermediate_size, hidden, rank, tp))
    if how == IN_MEMORY:
        t.update(merged_experts(hf + "experts.", me + "experts.", moe, hidden, rank, tp, layout))
    else:
        t.update(expert_targets(hf + "experts.", me + "experts.", E, moe.intermediate_size, hidden, rank, tp, layout,
                                names))
    return t


def kimi_tensors(cfg: ModelConfig, rank: int, tp: int, moe: MoeLayout = "ep",
                 how: str = ORIGINAL) -> dict[str, TensorTarget]:
    """Checkpoint tensor -> where it lands on this rank (``rank``/``tp``: the FFN's TP
    rank and degree), in spelling ``how``."""
    k: KimiConfig = cfg.hybrid
    P, h = k.prefix, cfg.hidden_size
    t = {P + "embed_tokens.weight": whole("embed_tokens.weight", cfg.vocab_size, h),
         P + "norm.weight": whole("norm.weight", h)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = whole("lm_head.weight", cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        hf, me = f"{P}layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"{hf}{norm}.weight"] = whole(f"{me}{norm}.weight", h)
        if i in k.kda.full_layers:
            t.update(latent_targets(hf + "self_attn.", me + "self_attn.", k.latent, h, cfg.num_heads,
                                    cfg.attention_bias))
        else:
            t.update(kda_targets(hf + "self_attn.", me + "self_attn.", k.kda, h, kimi_a_log(k.kda), how))
        module = hf + ("mlp." if how == IN_MEMORY else "block_sparse_moe.")  # (the dense MLP's too, once saved)
        if k.moe is not None and k.moe.is_sparse(i):
            t.update(moe_targets(module, me + "mlp.", k.moe, h, rank, tp, moe, how, ("w1", "w3", "w2")))
        else:
            t.update(sharded_mlp(module, me + "mlp.", cfg.intermediate_size, h, rank, tp))
    return t


def random_weights(table: dict[str, TensorTarget], dtype_name: str | None, seed: int) -> dict[str, torch.Tensor]:
    """Seeded Hub-named tensors of every shape a table lists (the presets' writer):
    matrices std fan_in ** -0.5, norms near 1, the KDA decays slow (``A_log`` of
    ``[1/32, 1/8]``-ish rates, ``dt_bias`` near 0: a state lasts tens of tokens), the
    convolutions of order 1 / sqrt(K), the router and its bias float32 (as transformers
    keeps them), the hyper-connections near transformers' initialisation."""
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[dtype_name or "float32"]
    out = {}
    for name, t in table.items():
        noise = torch.randn(t.shape, generator=g)
        if name.endswith("A_log"):
            w = (0.03 + 0.1 * torch.rand(t.shape, generator=g)).log()
        elif name.endswith("dt_bias"):
            w = 0.1 * noise
        elif "conv1d" in name:
            w = noise * t.shape[-1] ** -0.5
        elif name.endswith(("_base", "_scale", ".base", ".scale")):  # mHC's (transformers: zeros, ones)
            w = (1.0 if "scale" in name else 0.0) + 0.1 * noise
        elif len(t.shape) >= 2:
            w = noise * t.shape[-1] ** -0.5
        elif "norm" in name and not name.endswith("bias"):
            w = 1.0 + 0.1 * noise
        else:  # biases, the router's correction
            w = 0.02 * noise
        out[name] = w if t.float32 else w.to(dtype)
    return out
