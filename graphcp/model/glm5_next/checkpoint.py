"""Where each tensor of a GLM-5-Next checkpoint's text model lands on one rank, in either
spelling (graphcp.model.kimi_linear.checkpoint tells them apart and places the shared
parts):

- the *original* names ``save_pretrained`` writes: a layer's hyper-connections as
  ``hc_attn_fn`` / ``hc_attn_base`` / ``hc_attn_scale`` (and ``hc_ffn_*``), a KDA layer's
  ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` and its gate (``f_a_proj``, ``f_b_proj``,
  ``dt_bias``, ``A_log`` of shape ``[H]``) beside the projections, one tensor per expert
  (``experts.N.gate_proj`` / ``up_proj`` / ``down_proj``);
- transformers' *in-memory* names: ``attn_hc.fn`` / ``.base`` / ``.scale``, a stacked
  ``conv1d``, the gate under ``forget_gate.``, merged ``experts.gate_up_proj`` /
  ``down_proj``.

The text model's tensors are under ``model.language_model.``; the vision tower's
(``model.visual.``) are not read. An indexed layer that runs the indexer also holds
``indexer.wq_b`` / ``wk`` / ``k_norm`` / ``weights_proj`` and the pooling's
``index_kpool_compress_ape`` / ``index_kpool_compress_gate``.
"""

from __future__ import annotations

import torch

from graphcp.model.config import ModelConfig
from graphcp.model.glm5_next.config import Glm5Config
from graphcp.model.kimi_linear.checkpoint import IN_MEMORY, ORIGINAL, kda_targets, latent_targets, moe_targets, whole
from graphcp.model.kimi_linear.checkpoint import random_weights as kimi_random_weights
from graphcp.model.tensor_table import TensorTarget, sharded_mlp
from graphcp.options import MoeLayout

#: the vision tower and its merger: not the text model's (skipped, not refused)
VISION = "model.visual."


def hc_targets(hf: str, me: str, n: int, hidden: int, how: str) -> dict[str, TensorTarget]:
    """A layer's two hyper-connections (float32: transformers keeps base and scale so, and
    upcasts fn where it is used)."""
    width = (2 + n) * n
    t = {}
    for which in ("attn", "ffn"):
        for part, shape in (("fn", (width, n * hidden)), ("base", (width,)), ("scale", (3,))):
            name = f"{which}_hc.{part}" if how == IN_MEMORY else f"hc_{which}_{part}"
            t[hf + name] = whole(f"{me}{which}_hc.{part}", *shape, float32=True)
    return t


def indexer_targets(hf: str, me: str, g: Glm5Config, hidden: int) -> dict[str, TensorTarget]:
    """An indexed layer's indexer (``hf``: its ``indexer.`` prefix), whole on every rank."""
    ix, q = g.indexer, g.latent.q_lora_rank
    H, D = ix.n_heads, ix.head_dim
    return {hf + "wq_b.weight": whole(me + "wq_b.weight", H * D, q),
            hf + "wk.weight": whole(me + "wk.weight", D, hidden),
            hf + "k_norm.weight": whole(me + "k_norm.weight", D), hf + "k_norm.bias": whole(me + "k_norm.bias", D),
            hf + "weights_proj.weight": whole(me + "weights_proj.weight", H, hidden),
            hf + "index_kpool_compress_ape": whole(me + "ape", ix.kpool, D, float32=True),
            hf + "index_kpool_compress_gate": whole(me + "gate", D, hidden)}


def glm5_tensors(cfg: ModelConfig, rank: int, tp: int, moe: MoeLayout = "ep",
                 how: str = ORIGINAL) -> dict[str, TensorTarget]:
    """Checkpoint tensor -> where it lands on this rank (``rank``/``tp``: the FFN's TP
    rank and degree), in spelling ``how``."""
    g: Glm5Config = cfg.hybrid
    P, h = g.prefix, cfg.hidden_size
    t = {P + "embed_tokens.weight": whole("embed_tokens.weight", cfg.vocab_size, h),
         P + "norm.weight": whole("norm.weight", h)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = whole("lm_head.weight", cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        hf, me = f"{P}layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"{hf}{norm}.weight"] = whole(f"{me}{norm}.weight", h)
        t.update(hc_targets(hf, me, g.hc.mult, h, how))
        attn, mine = hf + "self_attn.", me + "self_attn."
        if i in g.kda.full_layers:
            t.update(latent_targets(attn, mine, g.latent, h, cfg.num_heads, cfg.attention_bias))
            if g.indexer.layers[i]:
                t.update(indexer_targets(attn + "indexer.", mine + "indexer.", g, h))
        else:
            t.update(kda_targets(attn, mine, g.kda, h, (g.kda.num_heads,), how))
        if g.moe is not None and g.moe.is_sparse(i):
            t.update(moe_targets(hf + "mlp.", me + "mlp.", g.moe, h, rank, tp, moe, how,
                                 ("gate_proj", "up_proj", "down_proj")))
        else:
            t.update(sharded_mlp(hf + "mlp.", me + "mlp.", cfg.intermediate_size, h, rank, tp))
    return t


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded tensors of every name and shape the original spelling lists (Kimi's
    recipe: graphcp.model.kimi_linear.checkpoint.random_weights: the indexer's pooling
    ape and gate as matrices, of order 1 / sqrt(fan-in))."""
    return kimi_random_weights(glm5_tensors(cfg, 0, 1, "tp"), cfg.torch_dtype, seed)
