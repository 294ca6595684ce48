"""A hybrid's decoder (graphcp.model.hybrid.layers for its layers): DecoderModel's body
and LM head with zero-centred norms, the partial RoPE of the full-attention layers and,
per layer, Gated DeltaNet or gated full attention, then the dense MLP or the MoE with its
gated shared expert. With ``--moe ep`` a MoE layer runs its mixer's tail (the gate or
gated norm and the output projection), the norm and the expert exchange in the mixer's
break, as the dense family's MoE layers do."""

from __future__ import annotations

import torch
from torch import nn

from graphcp.config import PipelineStage
from graphcp.model.config import ModelConfig
from graphcp.model.forward_context import ForwardContext
from graphcp.model.graph_break import graph_break
from graphcp.model.heads import HeadShard
from graphcp.model.hybrid.config import FULL
from graphcp.model.hybrid.layers import (
    STATIC_Z,
    CenteredRMSNorm,
    GatedAttention,
    GatedDeltaNet,
    GatedSharedExpert,
    PartialRotary,
    static_rows,
)
from graphcp.model.layers import ParallelMLP
from graphcp.model.llama import DecoderModel, ExpertParallelTail, attend
from graphcp.model.moe.block import SparseMoeBlock
from graphcp.nvtx_ranges import nvtx_range
from graphcp.options import MoeLayout

#: graph-mode static rows of a full layer's output gate, when its MoE runs in the break
STATIC_GATE = "attn_gate"


@graph_break("attention+moe")
def run_attention_moe(ctx: ForwardContext, layer: int, block: "HybridLayer", q: torch.Tensor, attn_out: torch.Tensor,
                      gate: torch.Tensor, resid: torch.Tensor, out: torch.Tensor) -> None:
    """A full layer's attention, output gate and o_proj, then its expert-parallel MoE."""
    attend(ctx, layer, q, attn_out)
    n = resid.shape[0]
    block.after_mixer(ctx, block.self_attn.project(attn_out.view(n, block.self_attn.cfg.q_size), gate, ctx), resid,
                      out)


@graph_break("linear-attention+moe")
def run_linear_moe(ctx: ForwardContext, layer: int, block: "HybridLayer", qkv: torch.Tensor, gates: torch.Tensor,
                   core: torch.Tensor, z: torch.Tensor, resid: torch.Tensor, out: torch.Tensor) -> None:
    """A linear layer's recurrence, gated norm and out_proj, then its expert-parallel MoE."""
    with nvtx_range(f"linear_attention[{layer}]", category="break"):
        block.linear_attn.core(ctx, qkv, gates, core)
    block.after_mixer(ctx, block.linear_attn.project(core, z, ctx), resid, out)


class HybridLayer(ExpertParallelTail):
    """One decoder layer: a Gated DeltaNet or gated full-attention mixer, then the MLP."""

    def __init__(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype, rank: int, moe: MoeLayout,
                 shard: HeadShard) -> None:
        super().__init__()
        self.layer = layer
        self.full = cfg.hybrid.layer_kinds[layer] == FULL
        self.input_layernorm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if self.full:
            self.self_attn = GatedAttention(cfg, layer, dtype, shard)
        else:
            self.linear_attn = GatedDeltaNet(cfg, layer, dtype, shard)
        self.post_attention_layernorm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        m = cfg.moe
        if m is not None and m.is_sparse(layer):
            self.mlp = SparseMoeBlock(m, cfg.hidden_size, moe, rank, tp_size, dtype)
            self.mlp.shared = GatedSharedExpert(cfg.hidden_size, m.shared_intermediate_size, tp_size, dtype)
        else:
            self.mlp = ParallelMLP(cfg.hidden_size, cfg.intermediate_size, tp_size, False, dtype)
        #: the MoE runs in the mixer's break (the expert-parallel exchange, or tp experts held
        #: out of CUDA graphs: DecoderModel.hold_experts_out_of_graphs)
        self.exchanges = isinstance(self.mlp, SparseMoeBlock) and moe == "ep"

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: nn.Module, ctx: ForwardContext):
        x = self.input_layernorm(h)
        if self.exchanges:
            return self._forward_in_break(h, x, positions, rotary, ctx)
        mixer = self.self_attn if self.full else self.linear_attn
        h = h + mixer(x, positions, rotary, ctx)
        return h + self.mlp(self.post_attention_layernorm(h), ctx.comm)

    def _forward_in_break(self, h, x, positions, rotary, ctx: ForwardContext) -> torch.Tensor:
        resid, out = self.break_rows(h, ctx)
        static = ctx.inputs.extra
        if self.full:
            q, attn_out, gate = self.self_attn.prepare(x, positions, rotary, ctx)
            if static is not None:
                gate = static[STATIC_GATE].copy_(gate)
            run_attention_moe(ctx, self.layer, self, q, attn_out, gate, resid, out)
            return out
        mixer = self.linear_attn
        qkv, z, gates = mixer.split(mixer.in_proj(x))
        qkv, gates, core = mixer.break_rows(ctx, qkv, gates)
        if static is not None:
            z = static[STATIC_Z].copy_(z)
        run_linear_moe(ctx, self.layer, self, qkv, gates, core, z, resid, out)
        return out

    def after_mixer(self, ctx: ForwardContext, mixed: torch.Tensor, resid: torch.Tensor, out: torch.Tensor) -> None:
        """The residual, the norm and the MoE (expert-parallel over the live rows, or the
        ``tp`` layout over every row); the layer's rows into ``out``."""
        h = resid + mixed
        live = resid.shape[0] if ctx.inputs.live_rows is None else ctx.inputs.live_rows
        with nvtx_range(f"moe[{self.layer}]", category="break"):
            x = self.post_attention_layernorm(h)
            moe = self.mlp.forward_ep(x, live, ctx.comm, ctx.stats) if self.mlp.layout == "ep" else self.mlp(
                x, ctx.comm)
        torch.add(h, moe, out=out)


class HybridModel(DecoderModel):
    """DecoderModel's body and LM head with a hybrid's layers, norms and RoPE."""

    def __init__(self, cfg: ModelConfig, tp_size: int, dtype: torch.dtype, max_positions: int | None = None,
                 rank: int = 0, moe: MoeLayout = "ep", stage: PipelineStage | None = None,
                 shard: HeadShard | None = None) -> None:
        super().__init__(cfg, tp_size, dtype, max_positions, rank, moe, stage, shard)
        if self.norm is not None:
            self.norm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def make_layer(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype, rank: int,
                   moe: MoeLayout) -> nn.Module:
        return HybridLayer(cfg, layer, tp_size, dtype, rank, moe, self.shard)

    @staticmethod
    def make_rotary(cfg: ModelConfig, max_positions: int | None = None) -> nn.Module:
        return PartialRotary(cfg.hybrid.rotary_dim, max_positions or cfg.max_position_embeddings, cfg.rope)

    def static_rows(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The linear layers' break rows, and a full layer's output gate when its MoE runs in the break."""
        rows: dict = {}
        linear = [layer for layer in self.layers if not layer.full]
        if linear:
            rows.update(static_rows(linear[0].linear_attn.dims, self.dtype))
        if any(layer.full and isinstance(layer.mlp, SparseMoeBlock) for layer in self.layers):
            acfg = self.attn_cfg
            rows[STATIC_GATE] = ((acfg.q_size,), self.dtype)
        return rows
