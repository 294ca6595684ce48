"""The DeepSeek V4 decoder (``DeepseekV4ForCausalLM``) on this rank's rows.

Per layer: mHC collapses the ``hc_mult`` streams -> norm -> attention (the window, and
a compressed layer's entries; graphcp/model/dsv4/attention.py) -> mHC mixes it back
-> mHC collapses -> norm -> MoE (hash- or score-routed, ``--moe ep|tp``) -> mHC mixes.
Everything but attention and the MoE is per token, so it runs on the rank's own rows
with no collective. With ``--moe ep`` (or tp experts held out of CUDA graphs) the MoE
runs in a second graph break of the layer (its exchange is sized on the host).
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.config import PipelineStage
from graphcp.model.config import ModelConfig
from graphcp.model.cp_attention import begin_forward
from graphcp.model.dsv4.attention import V4Attention
from graphcp.model.dsv4.attention import static_rows as attention_rows
from graphcp.model.dsv4.hc import HyperConnection, HyperHead, mix
from graphcp.model.dsv4.moe import V4MoeBlock
from graphcp.model.dsv4.norms import V4RMSNorm
from graphcp.model.dsv4.rope import V4Rotary
from graphcp.model.forward_context import ForwardContext
from graphcp.model.graph_break import graph_break
from graphcp.model.heads import HeadShard
from graphcp.model.llama import DecoderModel
from graphcp.nvtx_ranges import nvtx_range
from graphcp.options import MoeLayout

STATIC_MOE_IN, STATIC_MOE_OUT = "v4_moe_in", "v4_moe_out"


@graph_break("moe")
def run_moe(ctx: ForwardContext, layer: int, block: V4MoeBlock, x: torch.Tensor, token_ids: torch.Tensor,
            out: torch.Tensor) -> None:
    """The MoE of rows ``x`` (of tokens ``token_ids``: the body's input, a static buffer in
    graph mode) into ``out``: ``ep``'s exchange over the live rows, or ``tp`` experts held
    out of CUDA graphs."""
    with nvtx_range(f"moe[{layer}]", category="break"):
        if block.layout == "ep":
            live = x.shape[0] if ctx.inputs.live_rows is None else ctx.inputs.live_rows
            out.copy_(block.forward_ep(x, live, ctx.comm, ctx.stats, token_ids))
        else:
            out.copy_(block(x, ctx.comm, token_ids))


class DsV4Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype, rank: int,
                 moe: MoeLayout, shard: HeadShard | None = None) -> None:
        super().__init__()
        d, h, eps = cfg.dsv4, cfg.hidden_size, cfg.rms_norm_eps
        self.layer = layer
        self.attn_hc = HyperConnection(h, d.hc_mult, d.hc_sinkhorn_iters, d.hc_eps, eps)
        self.ffn_hc = HyperConnection(h, d.hc_mult, d.hc_sinkhorn_iters, d.hc_eps, eps)
        self.input_layernorm = V4RMSNorm(h, eps)
        self.self_attn = V4Attention(cfg, layer, dtype, shard)
        self.post_attention_layernorm = V4RMSNorm(h, eps)
        self.mlp = V4MoeBlock(d, h, cfg.vocab_size, d.hash_layers[layer], moe, rank, tp_size, dtype)
        #: the MoE runs in a graph break (the ep exchange; or tp experts held out of CUDA graphs)
        self.exchanges = moe == "ep"

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: V4Rotary, ctx: ForwardContext):
        """``h [rows, hc_mult, hidden]`` -> the same rows after the layer."""
        post, comb, x = self.attn_hc(h)
        h = mix(h, self.self_attn(self.input_layernorm(x), positions, rotary, ctx), post, comb)
        post, comb, x = self.ffn_hc(h)
        x = self.post_attention_layernorm(x)
        if self.exchanges:
            static = ctx.inputs.extra
            if static is not None:
                x, out = static[STATIC_MOE_IN].copy_(x), static[STATIC_MOE_OUT]
            else:
                out = torch.empty_like(x)
            run_moe(ctx, self.layer, self.mlp, x, ctx.inputs.token_ids, out)
        else:
            out = self.mlp(x, ctx.comm, ctx.inputs.token_ids)
        return mix(h, out, post, comb)


class DsV4Model(DecoderModel):
    """DecoderModel's embedding and LM head with V4 layers, the mHC streams and head."""

    def __init__(self, cfg: ModelConfig, tp_size: int, dtype: torch.dtype, max_positions: int | None = None,
                 rank: int = 0, moe: MoeLayout = "ep", stage: PipelineStage | None = None,
                 shard: HeadShard | None = None) -> None:
        super().__init__(cfg, tp_size, dtype, max_positions, rank, moe, stage, shard)
        d = cfg.dsv4
        last = self.stage.last  # the final collapse and norm
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if last else None
        self.hc_head = HyperHead(cfg.hidden_size, d.hc_mult, d.hc_eps, cfg.rms_norm_eps) if last else None
        for p in self.parameters():
            p.requires_grad_(False)

    def make_layer(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype, rank: int,
                   moe: MoeLayout) -> nn.Module:
        return DsV4Layer(cfg, layer, tp_size, dtype, rank, moe, self.shard)

    @staticmethod
    def make_rotary(cfg: ModelConfig, max_positions: int | None = None) -> nn.Module:
        return V4Rotary(cfg.dsv4, max_positions or cfg.max_position_embeddings)

    def body(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
             hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """Local rows in (token ids; a later pipeline stage's also the streams handed on,
        ``hidden_in [rows, hc_mult x hidden]``), out: the final-normed rows on the last
        stage, the streams flattened on the others."""
        begin_forward(ctx)
        ctx.inputs.token_ids = input_ids  # hash routing reads each row's token (on every stage)
        hc = self.cfg.dsv4.hc_mult
        if hidden_in is None:
            h = self.embed_tokens(input_ids).unsqueeze(1).expand(-1, hc, -1).contiguous()
        else:
            h = hidden_in.view(hidden_in.shape[0], hc, -1)
        for i, layer in zip(self.stage.layers, self.layers):
            with nvtx_range(f"layer[{i}]", category="eager"):
                h = layer(h, positions, self.rotary, ctx)
        return self.norm(self.hc_head(h)) if self.stage.last else h.flatten(1)

    @property
    def handoff_size(self) -> int:
        """The hc_mult residual streams of a row travel between stages."""
        return self.cfg.dsv4.hc_mult * self.cfg.hidden_size

    def static_rows(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        rows = attention_rows(self.attn_cfg, self.dtype)  # this rank's heads
        if self.exchanges:
            h = self.cfg.hidden_size
            rows.update({STATIC_MOE_IN: ((h,), self.dtype), STATIC_MOE_OUT: ((h,), self.dtype)})
        return rows
