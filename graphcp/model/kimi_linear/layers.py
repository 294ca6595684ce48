"""A KDA layer (Kimi Delta Attention) on this rank's rows, as Kimi Linear and GLM-5-Next
run it (docs/hybrid.md):

  in_proj (q | k | v | f_a | g_a | b) -> forget gate g = gate(f_b_proj(f_a)) per channel,
  beta = sigmoid(b) -> [break: the short convolutions (halo), l2-normalised q/k, the
  chunked rule, the scan across ranks, the state store] -> gated RMSNorm (sigmoid of
  g_b_proj(g_a)) -> o_proj

The break is the hybrid family's (graphcp.model.hybrid.scan through the forward's
exchange, graphcp.model.kimi_linear.exchange) with KDA's kernels: only the decay's shape
(a vector per head) and the rule differ from Gated DeltaNet's. A decode step is the
hybrid's step (graphcp.model.hybrid.step) with KDA's step kernels, no break. Every head on every rank
(these families run attention TP 1: their full layers are MLA).
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.attention.phase import DECODE
from graphcp.model.forward_context import ForwardContext
from graphcp.model.graph_break import graph_break
from graphcp.model.hybrid.exchange import linear_scan, linear_step
from graphcp.model.kimi_linear.cache import linear_dims
from graphcp.model.kimi_linear.config import KdaConfig
from graphcp.model.kimi_linear.kda import forget_gate, gated_norm
from graphcp.nvtx_ranges import nvtx_range

#: graph-mode static rows of a KDA layer's break (StaticBuffers' extra rows); the output
#: gate's only when the layer's MoE runs in the break after it
STATIC_QKV, STATIC_G, STATIC_BETA, STATIC_CORE, STATIC_GATE = "kda_qkv", "kda_g", "kda_beta", "kda_core", "kda_gate"


@graph_break("linear-attention")
def run_kda(ctx: ForwardContext, layer: int, mixer: "KdaAttention", qkv: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, core: torch.Tensor) -> None:
    """A KDA layer's recurrence over the live batch (the convolution's halo, the rule, the
    scan across ranks and the state store): writes ``core``."""
    with nvtx_range(f"linear_attention[{layer}]", category="break"):
        mixer.core(ctx, qkv, g, beta, core)


class KdaAttention(nn.Module):
    """``a_log_shape``: ``A_log``'s shape as the checkpoint holds it (Kimi: ``[1, 1, H, 1]``,
    GLM-5-Next: ``[H]``)."""

    def __init__(self, kda: KdaConfig, hidden: int, eps: float, layer: int, dtype: torch.dtype,
                 a_log_shape: tuple[int, ...]) -> None:
        super().__init__()
        H, D, K = kda.num_heads, kda.head_dim, kda.conv_kernel
        self.kda, self.layer, self.eps = kda, layer, eps
        self.dims = linear_dims(H, D, K)
        self.in_proj = nn.Linear(hidden, kda.conv_dim + 2 * D + H, bias=False, dtype=dtype)
        self.f_b_proj = nn.Linear(D, H * D, bias=False, dtype=dtype)
        self.g_b_proj = nn.Linear(D, H * D, bias=False, dtype=dtype)
        self.conv1d = nn.Parameter(torch.empty(kda.conv_dim, 1, K, dtype=torch.float32 if kda.conv_float32 else dtype))
        self.dt_bias = nn.Parameter(torch.empty(H * D, dtype=torch.float32))  # (float32: a bfloat16 A_log is exact)
        self.a_log = nn.Parameter(torch.empty(a_log_shape, dtype=torch.float32))
        self.o_norm = nn.Parameter(torch.empty(D, dtype=dtype))
        self.o_proj = nn.Linear(H * D, hidden, bias=False, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def prepare(self, x: torch.Tensor, ctx: ForwardContext, gate_in_break: bool = False):
        """Everything before the break: the pre-convolution rows, the float32 log decays
        ``[n, H, d]`` and betas ``[n, H]``, the rows the break writes and the output gate
        (a static row when ``gate_in_break``: the layer's MoE runs in the break after it)."""
        k, n = self.kda, x.shape[0]
        D = k.head_dim
        qkv, fa, ga, b = self.in_proj(x).split([k.conv_dim, D, D, k.num_heads], dim=-1)
        g = forget_gate(self.f_b_proj(fa), self.dt_bias, self.a_log, k.num_heads, k.lower_bound)
        beta, gate = torch.sigmoid(b).float(), self.g_b_proj(ga)
        static = ctx.inputs.extra
        if static is None:
            return qkv, g, beta, qkv.new_empty(n, k.num_heads, D), gate
        rows = (static[STATIC_QKV].copy_(qkv), static[STATIC_G].copy_(g), static[STATIC_BETA].copy_(beta),
                static[STATIC_CORE])
        return (*rows, static[STATIC_GATE].copy_(gate) if gate_in_break else gate)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv, g, beta, core, gate = self.prepare(x, ctx)
        if ctx.phase == DECODE:  # no break: the step reads nothing on the host
            self.step(ctx, qkv, g, beta, core)
        else:
            run_kda(ctx, self.layer, self, qkv, g, beta, core)
        return self.project(core, gate)

    def project(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm (per head, sigmoid of the gate) and o_proj."""
        n, k = core.shape[0], self.kda
        y = gated_norm(core.view(n, k.num_heads, k.head_dim), gate.view(n, k.num_heads, k.head_dim), self.o_norm,
                       self.eps)
        return self.o_proj(y.reshape(n, k.qkv_dim))

    def core(self, ctx: ForwardContext, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             out: torch.Tensor) -> None:
        """The break's work on the live rows (padding rows get zeros); a decode step's one
        token a request."""
        if ctx.phase == DECODE:
            self.step(ctx, qkv, g, beta, out)
            return
        scan = linear_scan(ctx.kv)
        n = scan.plan.rows
        out[n:].zero_()
        if scan.plan.empty:
            return
        k = self.kda
        x, got = scan.convolve(self.layer, qkv, self.conv1d[:, 0])  # [rows, conv_dim], the model's dtype
        q, key, v = (t.unflatten(-1, (k.num_heads, k.head_dim)) for t in x.split(k.qkv_dim, dim=-1))
        o, received = scan.run(self.layer, q, key, v, g[:n], beta[:n])  # (the kernels normalise q and k)
        out[:n].copy_(o)
        ctx.add_received(got + received)

    def step(self, ctx: ForwardContext, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             out: torch.Tensor) -> None:
        """A decode step (the hybrid's, graphcp.model.hybrid.step, with the exchange's KDA
        step kernels): every row's token after its request's states, on the ranks that keep
        them; writes ``out`` (the owner's, broadcast, under the layer split)."""
        step = linear_step(ctx.kv)
        if step.computes(self.layer):
            k = self.kda
            x = step.convolve(self.layer, qkv, self.conv1d[:, 0])
            q, key, v = (t.unflatten(-1, (k.num_heads, k.head_dim)) for t in x.split(k.qkv_dim, dim=-1))
            out.copy_(step.run(self.layer, q, key, v, g, beta))
        ctx.add_received(step.share(self.layer, out))


def static_rows(kda: KdaConfig, dtype: torch.dtype, gate: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The KDA layers' static break rows (per row shape and dtype) for graph mode; the
    output gate's when some KDA layer's MoE runs in the break (``gate``)."""
    H, D = kda.num_heads, kda.head_dim
    rows = {STATIC_QKV: ((kda.conv_dim,), dtype), STATIC_G: ((H, D), torch.float32),
            STATIC_BETA: ((H,), torch.float32), STATIC_CORE: ((H, D), dtype)}
    if gate:
        rows[STATIC_GATE] = ((H * D,), dtype)
    return rows
