"""Kimi Linear's decoder (``KimiLinearForCausalLM``) on this rank's rows.

Per layer: RMSNorm -> a KDA layer (graphcp.model.kimi_linear.layers) or MLA with no
positional encoding (graphcp.model.kimi_linear.mla) -> residual -> RMSNorm -> the dense
MLP (the first layers) or DeepSeek's MoE (sigmoid router with groups, a shared expert,
``routed_scaling_factor``: graphcp.model.moe, ``--moe ep|tp``) -> residual. With
``--moe ep`` a MoE layer runs its mixer's tail (o_proj, or the gated norm and o_proj),
the norm and the expert exchange in the mixer's break, as the other MoE families do.
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.model.config import ModelConfig
from graphcp.model.dsa.mla import run_sparse_mla_moe
from graphcp.model.forward_context import ForwardContext
from graphcp.model.graph_break import graph_break
from graphcp.model.hybrid.export import FULL
from graphcp.model.kimi_linear.config import KimiConfig, kimi_a_log
from graphcp.model.kimi_linear.layers import KdaAttention
from graphcp.model.kimi_linear.layers import static_rows as kda_rows
from graphcp.model.kimi_linear.mla import LatentAttention
from graphcp.model.kimi_linear.mla import static_rows as mla_rows
from graphcp.model.layers import ParallelMLP, RMSNorm
from graphcp.model.llama import DecoderModel, ExpertParallelTail
from graphcp.model.moe.block import SparseMoeBlock
from graphcp.nvtx_ranges import nvtx_range
from graphcp.options import MoeLayout


@graph_break("linear-attention+moe")
def run_kda_moe(ctx: ForwardContext, layer: int, block: "KimiLayer", qkv: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, core: torch.Tensor, gate: torch.Tensor, resid: torch.Tensor,
                out: torch.Tensor) -> None:
    """A KDA layer's recurrence, gated norm and o_proj, then its expert-parallel MoE."""
    mixer = block.self_attn
    with nvtx_range(f"linear_attention[{layer}]", category="break"):
        mixer.core(ctx, qkv, g, beta, core)
    h = resid + mixer.project(core, gate)
    live = resid.shape[0] if ctx.inputs.live_rows is None else ctx.inputs.live_rows
    with nvtx_range(f"moe[{layer}]", category="break"):
        x = block.post_attention_layernorm(h)
        moe = block.mlp.forward_ep(x, live, ctx.comm, ctx.stats) if block.mlp.layout == "ep" else block.mlp(
            x, ctx.comm)
    torch.add(h, moe, out=out)


class NoRotary(nn.Module):
    """No positional encoding: nothing to tabulate (the loader still builds one)."""


class KimiLayer(ExpertParallelTail):
    def __init__(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype, rank: int,
                 moe: MoeLayout) -> None:
        super().__init__()
        k: KimiConfig = cfg.hybrid
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer = layer
        self.full = k.kda.layer_kinds[layer] == FULL
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.self_attn = (LatentAttention(k.latent, h, cfg.num_heads, layer, dtype, cfg.attention_bias) if self.full
                          else KdaAttention(k.kda, h, eps, layer, dtype, kimi_a_log(k.kda)))
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        if k.moe is not None and k.moe.is_sparse(layer):
            self.mlp = SparseMoeBlock(k.moe, h, moe, rank, tp_size, dtype)
        else:
            self.mlp = ParallelMLP(h, cfg.intermediate_size, tp_size, False, dtype)
        #: the MoE runs in the mixer's break: experts split over the ranks (the all-to-all), or
        #: tp experts held out of CUDA graphs (DecoderModel.hold_experts_out_of_graphs)
        self.exchanges = isinstance(self.mlp, SparseMoeBlock) and moe == "ep"

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: nn.Module, ctx: ForwardContext):
        x = self.input_layernorm(h)
        if self.exchanges:
            return self._forward_in_break(h, x, ctx)
        h = h + self.self_attn(x, ctx)
        return h + self.mlp(self.post_attention_layernorm(h), ctx.comm)

    def _forward_in_break(self, h: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        resid, out = self.break_rows(h, ctx)
        a = self.self_attn
        if self.full:
            q, index_q, index_w, attn_out = a.prepare(x, ctx)
            run_sparse_mla_moe(ctx, self.layer, self, q, index_q, index_w, a.kv_b_proj.weight, attn_out, resid, out)
        else:
            qkv, g, beta, core, gate = a.prepare(x, ctx, gate_in_break=True)
            run_kda_moe(ctx, self.layer, self, qkv, g, beta, core, gate, resid, out)
        return out


class KimiModel(DecoderModel):
    """DecoderModel's body and LM head with Kimi Linear's layers (no RoPE tables)."""

    def make_layer(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype, rank: int,
                   moe: MoeLayout) -> nn.Module:
        return KimiLayer(cfg, layer, tp_size, dtype, rank, moe)

    @staticmethod
    def make_rotary(cfg: ModelConfig, max_positions: int | None = None) -> nn.Module:
        return NoRotary()

    def static_rows(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The KDA layers' break rows (the output gate's when a KDA layer's MoE runs in its
        break) and the MLA layers' attention rows."""
        k: KimiConfig = self.cfg.hybrid
        rows: dict = {}
        linear = [layer for layer in self.layers if not layer.full]
        if linear:
            rows.update(kda_rows(k.kda, self.dtype, any(layer.exchanges for layer in linear)))
        if any(layer.full for layer in self.layers):
            rows.update(mla_rows(k.latent, self.cfg.num_heads, self.dtype))
        return rows
