"""GLM-5-Next's text decoder (``Glm5NextTextModel``) on this rank's rows.

Per layer, on ``hc_mult`` residual streams (graphcp.model.dsv4.hc, DeepSeek V4's mHC:
transformers' ``Glm5NextTextHyperConnection`` is the same computation):

  collapse (attn_hc) -> RMSNorm -> a KDA layer (graphcp.model.kimi_linear.layers) or MLA
  with no RoPE and the pooled indexer (graphcp.model.kimi_linear.mla with
  graphcp.model.glm5_next.indexer) -> mix back -> collapse (ffn_hc) -> RMSNorm -> the
  dense MLP or DeepSeek's MoE (SwiGLUs clamped at ``swiglu_limit``) -> mix back

and after the last layer the streams' plain mean (not V4's weighted head), then the
norm. Everything but the mixers' breaks and the MoE is per token. With ``--moe ep`` (or
tp experts held out of CUDA graphs) the MoE runs in a break of its own, as V4's does.
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.errors import BatchError
from graphcp.model.config import ModelConfig
from graphcp.model.cp_attention import begin_forward
from graphcp.model.dsv4.hc import HyperConnection, mix
from graphcp.model.forward_context import ForwardContext
from graphcp.model.glm5_next.config import Glm5Config
from graphcp.model.glm5_next.indexer import Glm5Indexer
from graphcp.model.graph_break import graph_break
from graphcp.model.hybrid.export import FULL
from graphcp.model.kimi_linear.layers import KdaAttention
from graphcp.model.kimi_linear.layers import static_rows as kda_rows
from graphcp.model.kimi_linear.mla import LatentAttention
from graphcp.model.kimi_linear.mla import static_rows as mla_rows
from graphcp.model.kimi_linear.model import NoRotary
from graphcp.model.layers import ParallelMLP, RMSNorm
from graphcp.model.llama import DecoderModel
from graphcp.model.moe.block import SparseMoeBlock
from graphcp.nvtx_ranges import nvtx_range
from graphcp.options import MoeLayout

STATIC_MOE_IN, STATIC_MOE_OUT = "glm_moe_in", "glm_moe_out"


@graph_break("moe")
def run_moe(ctx: ForwardContext, layer: int, block: SparseMoeBlock, x: torch.Tensor, out: torch.Tensor) -> None:
    """The MoE of rows ``x`` into ``out``: ``ep``'s exchange over the live rows, or ``tp``
    experts held out of CUDA graphs."""
    with nvtx_range(f"moe[{layer}]", category="break"):
        if block.layout == "ep":
            live = x.shape[0] if ctx.inputs.live_rows is None else ctx.inputs.live_rows
            out.copy_(block.forward_ep(x, live, ctx.comm, ctx.stats))
        else:
            out.copy_(block(x, ctx.comm))


class Glm5Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype, rank: int,
                 moe: MoeLayout) -> None:
        super().__init__()
        g: Glm5Config = cfg.hybrid
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer = layer
        self.full = g.kda.layer_kinds[layer] == FULL
        self.attn_hc = HyperConnection(h, g.hc.mult, g.hc.sinkhorn_iters, g.hc.eps, eps)
        self.ffn_hc = HyperConnection(h, g.hc.mult, g.hc.sinkhorn_iters, g.hc.eps, eps)
        self.input_layernorm = RMSNorm(h, eps, dtype)
        if self.full:
            ix = g.indexer
            indexer = Glm5Indexer(ix, h, g.latent.q_lora_rank, dtype) if ix.layers[layer] else None
            self.self_attn = LatentAttention(g.latent, h, cfg.num_heads, layer, dtype, cfg.attention_bias, indexer)
        else:
            self.self_attn = KdaAttention(g.kda, h, eps, layer, dtype, (g.kda.num_heads,))
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        if g.moe is not None and g.moe.is_sparse(layer):
            self.mlp = SparseMoeBlock(g.moe, h, moe, rank, tp_size, dtype, g.swiglu_limit)
        else:
            self.mlp = ParallelMLP(h, cfg.intermediate_size, tp_size, False, dtype, g.swiglu_limit)
        #: the MoE runs in a break: experts split over the ranks (the all-to-all), or tp
        #: experts held out of CUDA graphs (DecoderModel.hold_experts_out_of_graphs)
        self.exchanges = isinstance(self.mlp, SparseMoeBlock) and moe == "ep"

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: nn.Module, ctx: ForwardContext):
        """``h [rows, hc_mult, hidden]`` -> the same rows after the layer."""
        post, comb, x = self.attn_hc(h)
        h = mix(h, self.self_attn(self.input_layernorm(x), ctx), post, comb)
        post, comb, x = self.ffn_hc(h)
        x = self.post_attention_layernorm(x)
        if self.exchanges:
            static = ctx.inputs.extra
            if static is not None:
                x, out = static[STATIC_MOE_IN].copy_(x), static[STATIC_MOE_OUT]
            else:
                out = torch.empty_like(x)
            run_moe(ctx, self.layer, self.mlp, x, out)
        else:
            out = self.mlp(x, ctx.comm)
        return mix(h, out, post, comb)


class Glm5Model(DecoderModel):
    """DecoderModel's embedding and LM head with GLM-5-Next's layers and streams (no RoPE)."""

    def make_layer(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype, rank: int,
                   moe: MoeLayout) -> nn.Module:
        return Glm5Layer(cfg, layer, tp_size, dtype, rank, moe)

    @staticmethod
    def make_rotary(cfg: ModelConfig, max_positions: int | None = None) -> nn.Module:
        return NoRotary()

    def body(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
             hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """Local rows in (token ids; a later pipeline stage's the streams handed on,
        ``hidden_in [rows, hc_mult x hidden]``), out: the final-normed mean of the streams
        on the last stage, the streams flattened on the others."""
        if ctx.aux is not None:  # (RuntimeConfig's is refused with the config: Glm5Family.check_run)
            raise BatchError("prefill: aux_hidden_layers with a GLM-5-Next model: a layer's output is hc_mult "
                             "residual streams, not one hidden row to copy out; leave it unset")
        begin_forward(ctx)
        n = self.cfg.hybrid.hc.mult
        if hidden_in is None:
            h = self.embed_tokens(input_ids).unsqueeze(1).expand(-1, n, -1).contiguous()
        else:
            h = hidden_in.view(hidden_in.shape[0], n, -1)
        for i, layer in zip(self.stage.layers, self.layers):
            with nvtx_range(f"layer[{i}]", category="eager"):
                h = layer(h, positions, self.rotary, ctx)
        return self.norm(h.mean(dim=1)) if self.stage.last else h.flatten(1)

    @property
    def handoff_size(self) -> int:
        """The hc_mult residual streams of a row travel between stages."""
        return self.cfg.hybrid.hc.mult * self.cfg.hidden_size

    def static_rows(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The KDA layers' break rows, the indexed layers' attention rows (with the
        indexer's query and weights) and, when some MoE runs in a break, its rows."""
        g: Glm5Config = self.cfg.hybrid
        rows: dict = {}
        if any(not layer.full for layer in self.layers):
            rows.update(kda_rows(g.kda, self.dtype, False))
        if any(layer.full for layer in self.layers):
            rows.update(mla_rows(g.latent, self.cfg.num_heads, self.dtype, g.indexer.n_heads, g.indexer.head_dim))
        if self.exchanges:
            h = self.cfg.hidden_size
            rows.update({STATIC_MOE_IN: ((h,), self.dtype), STATIC_MOE_OUT: ((h,), self.dtype)})
        return rows
