"""A hybrid's layers (docs/hybrid.md): the zero-centred RMSNorm, the full-attention layer
with its output gate and partial RoPE, the Gated DeltaNet layer and the decoder layer
around either.

Per linear layer, on this rank's rows:
  norm -> in_proj (q/k/v, z, b, a) -> [break: convolution (halo), gated delta rule,
  scan across ranks, state store] -> gated RMSNorm (z) -> out_proj -> residual -> MLP
  (a decode step: the one-token step instead of the break, graphcp.model.hybrid.step:
  device work of fixed shape, which a decode graph captures)
Per full layer:
  norm -> q (and its gate) / k / v -> q/k norm -> partial RoPE -> K/V store ->
  [break: attention] -> times sigmoid(gate) -> o_proj -> residual -> MLP
Heads split over attention TP in both (a rank's key heads and the value heads they serve).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphcp.attention.phase import DECODE
from graphcp.model.config import ModelConfig
from graphcp.model.cp_attention import store_kv
from graphcp.model.forward_context import ForwardContext
from graphcp.model.graph_break import graph_break
from graphcp.model.heads import HeadShard, local_config
from graphcp.model.hybrid.cache import LinearDims
from graphcp.model.hybrid.exchange import linear_scan, linear_step
from graphcp.model.hybrid.gdn import decay_and_beta, gated_rms_norm
from graphcp.model.layers import ParallelMLP, Rotary
from graphcp.model.llama import run_attention
from graphcp.nvtx_ranges import nvtx_range

#: graph-mode static rows of a linear layer's break (StaticBuffers' extra rows)
STATIC_QKV, STATIC_GATES, STATIC_CORE, STATIC_Z = "linear_qkv", "linear_gates", "linear_core", "linear_z"


class CenteredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: normalised in float32, scaled by ``1 + weight`` in float32, cast."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class PartialRotary(nn.Module):
    """RoPE on the first ``dim`` channels of each head (transformers' partial rotary)."""

    def __init__(self, dim: int, max_positions: int, rope) -> None:
        super().__init__()
        self.dim = dim
        self.inner = Rotary(dim, max_positions, rope)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        d = self.dim
        qr, kr = self.inner(q[..., :d], k[..., :d], positions)
        return torch.cat([qr, q[..., d:]], dim=-1), torch.cat([kr, k[..., d:]], dim=-1)


class GatedAttention(nn.Module):
    """A full-attention layer over this rank's heads: q_proj gives each head's query and
    output gate (``[q | gate]`` a head), q/k RMSNorm, partial RoPE, the cache mode's
    store and attention, ``out * sigmoid(gate)``, o_proj (row-parallel under attention TP)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, shard: HeadShard) -> None:
        super().__init__()
        self.layer, self.shard = layer, shard
        self.cfg = cfg = local_config(cfg, shard)
        bias = cfg.attention_bias
        self.qkv = nn.Linear(cfg.hidden_size, 2 * cfg.q_size + 2 * cfg.kv_size, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)
        self.q_norm = CenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = CenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def prepare(self, x: torch.Tensor, positions: torch.Tensor, rotary: nn.Module, ctx: ForwardContext):
        """The query rows, the tensor attention writes and the output gate."""
        cfg, n = self.cfg, x.shape[0]
        qg, k, v = self.qkv(x).split([2 * cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q, gate = qg.view(n, cfg.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(n, cfg.num_kv_heads, cfg.head_dim))
        q, k = rotary(q, k, positions)
        store_kv(ctx, self.layer, k, v.view(n, cfg.num_kv_heads, cfg.head_dim))
        static = ctx.inputs
        if static.attn_q is not None:
            return static.attn_q.copy_(q), static.attn_out, gate.reshape(n, cfg.q_size)
        return q.contiguous(), torch.zeros_like(q), gate.reshape(n, cfg.q_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: nn.Module, ctx: ForwardContext):
        q, out, gate = self.prepare(x, positions, rotary, ctx)
        run_attention(ctx, self.layer, q, out)
        return self.project(out.view(x.shape[0], self.cfg.q_size), gate, ctx)

    def project(self, attn: torch.Tensor, gate: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        attn = attn * torch.sigmoid(gate)
        if not self.shard.split:
            return self.o_proj(attn)
        y = ctx.comm.reduce_attention(F.linear(attn, self.o_proj.weight))
        return y if self.o_proj.bias is None else y + self.o_proj.bias


@graph_break("linear-attention")
def run_linear(ctx: ForwardContext, layer: int, mixer: "GatedDeltaNet", qkv: torch.Tensor, gates: torch.Tensor,
               core: torch.Tensor) -> None:
    """A linear layer's recurrence over the live batch (the convolution's halo, the rule,
    the scan across ranks and the state store): writes ``core``."""
    with nvtx_range(f"linear_attention[{layer}]", category="break"):
        mixer.core(ctx, qkv, gates, core)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer over this rank's key heads and the value heads they serve."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, shard: HeadShard) -> None:
        super().__init__()
        h = cfg.hybrid
        A = shard.size
        self.layer, self.shard, self.packed, self.eps = layer, shard, h.packed, cfg.rms_norm_eps
        self.dims = d = LinearDims(h.num_k_heads // A, h.num_v_heads // A, h.k_head_dim, h.v_head_dim,
                                   h.conv_kernel)
        self.group = h.group
        self.in_proj = nn.Linear(cfg.hidden_size, d.conv_dim + d.num_v_heads * (d.v_head_dim + 2), bias=False,
                                 dtype=dtype)
        self.conv1d = nn.Parameter(torch.empty(d.conv_dim, 1, d.conv_kernel, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(d.num_v_heads, dtype=dtype), requires_grad=False)
        self.a_log = nn.Parameter(torch.empty(d.num_v_heads, dtype=dtype), requires_grad=False)
        self.norm = nn.Parameter(torch.empty(d.v_head_dim, dtype=dtype), requires_grad=False)
        self.out_proj = nn.Linear(d.num_v_heads * d.v_head_dim, cfg.hidden_size, bias=False, dtype=dtype)

    def split(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections ``[n, conv_dim]`` (q, k, v: the convolution's channels), ``z``
        ``[n, Hv, d_v]`` and the gates ``[n, 2 Hv]`` (b, a). Qwen3-Next packs them per key
        head (``[q | k | v | z]`` and ``[b | a]``), Qwen3.5 keeps them apart."""
        d, n = self.dims, proj.shape[0]
        hv = d.num_v_heads * d.v_head_dim
        if not self.packed:
            qkv, z, gates = proj.split([d.conv_dim, hv, 2 * d.num_v_heads], dim=-1)
            return qkv, z.view(n, d.num_v_heads, d.v_head_dim), gates
        r, hk = self.group, d.num_k_heads
        width = 2 * d.k_head_dim + 2 * r * d.v_head_dim
        qkvz = proj[:, :hk * width].view(n, hk, width)
        q, k, v, z = qkvz.split([d.k_head_dim, d.k_head_dim, r * d.v_head_dim, r * d.v_head_dim], dim=-1)
        b, a = proj[:, hk * width:].view(n, hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(n, hk * d.k_head_dim), k.reshape(n, hk * d.k_head_dim),
                         v.reshape(n, d.num_v_heads * d.v_head_dim)], dim=-1)
        gates = torch.cat([b.reshape(n, d.num_v_heads), a.reshape(n, d.num_v_heads)], dim=-1)
        return qkv, z.reshape(n, d.num_v_heads, d.v_head_dim), gates

    def break_rows(self, ctx: ForwardContext, qkv: torch.Tensor, gates: torch.Tensor):
        """What the break reads and writes: the static rows in graph mode."""
        static = ctx.inputs.extra
        d = self.dims
        if static is None:
            return qkv, gates, qkv.new_empty(qkv.shape[0], d.num_v_heads, d.v_head_dim)
        return static[STATIC_QKV].copy_(qkv), static[STATIC_GATES].copy_(gates), static[STATIC_CORE]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: nn.Module, ctx: ForwardContext):
        qkv, z, gates = self.split(self.in_proj(x))
        if ctx.phase == DECODE:  # no break: the step reads nothing on the host
            core = qkv.new_empty(qkv.shape[0], self.dims.num_v_heads, self.dims.v_head_dim)
            self.step(ctx, qkv, gates, core)
            return self.project(core, z, ctx)
        qkv, gates, core = self.break_rows(ctx, qkv, gates)
        run_linear(ctx, self.layer, self, qkv, gates, core)
        return self.project(core, z, ctx)

    def project(self, core: torch.Tensor, z: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The gated RMSNorm (per value head, gate ``z``) and out_proj (row-parallel under
        attention TP)."""
        n = core.shape[0]
        d = self.dims
        y = gated_rms_norm(core.view(n, d.num_v_heads, d.v_head_dim), z, self.norm, self.eps)
        y = y.reshape(n, d.num_v_heads * d.v_head_dim)
        if not self.shard.split:
            return self.out_proj(y)
        return ctx.comm.reduce_attention(F.linear(y, self.out_proj.weight))

    def core(self, ctx: ForwardContext, qkv: torch.Tensor, gates: torch.Tensor, out: torch.Tensor) -> None:
        """The break's work on the live rows (padding rows get zeros); a decode step's one
        token a request."""
        if ctx.phase == DECODE:
            self.step(ctx, qkv, gates, out)
            return
        scan = linear_scan(ctx.kv)
        n = scan.plan.rows
        out[n:].zero_()
        if scan.plan.empty:
            return
        d = self.dims
        x, got = scan.convolve(self.layer, qkv, self.conv1d[:, 0])  # [rows, conv_dim], the model's dtype
        hk = d.num_k_heads * d.k_head_dim
        q, k, v = x.split([hk, hk, d.num_v_heads * d.v_head_dim], dim=-1)
        b, a = gates[:n].split(d.num_v_heads, dim=-1)
        g, beta = decay_and_beta(b, a, self.a_log, self.dt_bias)
        o, received = scan.run(self.layer, q.unflatten(-1, (d.num_k_heads, d.k_head_dim)),
                               k.unflatten(-1, (d.num_k_heads, d.k_head_dim)),
                               v.unflatten(-1, (d.num_v_heads, d.v_head_dim)), g, beta)
        out[:n].copy_(o)
        ctx.add_received(got + received)

    def step(self, ctx: ForwardContext, qkv: torch.Tensor, gates: torch.Tensor, out: torch.Tensor) -> None:
        """A decode step (graphcp.model.hybrid.step): every row's token after its request's
        states, on the ranks that keep them; writes ``out`` (the owner's, broadcast, under
        the layer split)."""
        step = linear_step(ctx.kv)
        if step.computes(self.layer):
            d = self.dims
            x = step.convolve(self.layer, qkv, self.conv1d[:, 0])
            hk = d.num_k_heads * d.k_head_dim
            q, k, v = x.split([hk, hk, d.num_v_heads * d.v_head_dim], dim=-1)
            b, a = gates.split(d.num_v_heads, dim=-1)
            g, beta = decay_and_beta(b, a, self.a_log, self.dt_bias)
            out.copy_(step.run(self.layer, q.unflatten(-1, (d.num_k_heads, d.k_head_dim)),
                               k.unflatten(-1, (d.num_k_heads, d.k_head_dim)),
                               v.unflatten(-1, (d.num_v_heads, d.v_head_dim)), g, beta))
        ctx.add_received(step.share(self.layer, out))


def static_rows(dims: LinearDims, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The linear layers' static break rows (per row shape and dtype) for graph mode; ``z``
    for a layer whose MoE runs in the break."""
    d = dims
    return {STATIC_QKV: ((d.conv_dim,), dtype), STATIC_GATES: ((2 * d.num_v_heads,), dtype),
            STATIC_CORE: ((d.num_v_heads, d.v_head_dim), dtype), STATIC_Z: ((d.num_v_heads, d.v_head_dim), dtype)}


class GatedSharedExpert(ParallelMLP):
    """A MoE layer's shared expert behind a sigmoid gate: ``sigmoid(x W_g) * mlp(x)``
    (Qwen3.5-MoE and Qwen3-Next's ``shared_expert`` and ``shared_expert_gate``)."""

    def __init__(self, hidden: int, intermediate: int, tp_size: int, dtype: torch.dtype) -> None:
        super().__init__(hidden, intermediate, tp_size, False, dtype)
        self.gate = nn.Parameter(torch.empty(1, hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, group) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.gate)) * super().forward(x, group)


