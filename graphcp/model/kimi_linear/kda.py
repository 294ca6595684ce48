"""Kimi Delta Attention's math, the torch reference (ported from transformers' fallbacks in
``modeling_kimi_linear.py`` / ``modeling_glm5_next.py``: ``chunk_kimi_delta_attention``,
``recurrent_kimi_delta_attention``, ``KimiLinearForgetGate``, ``KimiLinearRMSNormGated``),
on a batch of *blocks* (runs of consecutive tokens of one request, padded to whole chunks)
as graphcp.model.hybrid.scan runs them.

KDA is the gated delta rule with a decay per key channel instead of per head: per head
the state ``S`` (``[d_k, d_v]``, float32) is

    S_t = (I - b_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,    o_t = q_t^T S_t

with ``g_t`` a ``d_k`` vector of log decays. It is still affine in ``S_{t-1}``, so a block
maps its incoming state as ``S_out = X S_in + Y`` and the augmented pass of
graphcp.model.hybrid.gdn (``augmented_rule``) and the scan across ranks apply unchanged:
:func:`chunk_kda` is the ``rule`` they call.

Padding rows (past a block's length) have ``q = k = v = 0``, ``b = 0`` and ``g = 0``: the
state passes through them unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphcp.model.hybrid.gdn import CHUNK, block_conv

#: transformers' softplus threshold in the forget gate (``where(g > 20, g, log(1 + exp(g)))``)
SOFTPLUS_THRESHOLD = 20.0


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and fla's) KDA l2norm: ``x / sqrt(sum(x^2) + eps)`` (a division, not
    Gated DeltaNet's ``rsqrt`` product)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def query_key(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 queries and keys ``[..., H, d_k]``: l2-normalised, queries scaled by
    ``1 / sqrt(d_k)`` (transformers' ``use_qk_l2norm_in_kernel``, in its order)."""
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * (1 / (q.shape[-1] ** 0.5)), k


def forget_gate(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, heads: int,
                lower_bound: float | None = None) -> torch.Tensor:
    """float32 log decays ``[n, H, d]`` of the forget gate's rows ``f`` ``[n, H d]``
    (``f_b_proj(f_a_proj(x))``, model dtype): ``g = f + dt_bias`` (float32), then
    ``-exp(A_log) softplus(g)`` (Kimi), or ``lower_bound sigmoid(exp(A_log) g)`` when the
    model bounds it (GLM-5-Next's ``linear_lower_bound``)."""
    n = f.shape[0]
    g = (f.float() + dt_bias.float().view(1, -1)).view(n, heads, -1)
    decay = a_log.float().reshape(1, heads, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(decay * g)
    return -decay * torch.where(g > SOFTPLUS_THRESHOLD, g, torch.log(1.0 + torch.exp(g)))


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked KDA rule over ``B`` blocks at once (float32): ``q``, ``k`` ``[B, H, T,
    d_k]`` (normalised, :func:`query_key`), ``v`` ``[B, H, T, d_v]``, ``g`` ``[B, H, T,
    d_k]`` (log decays), ``beta`` ``[B, H, T]``, ``T`` a multiple of ``chunk``, each block
    from ``initial`` ``[B, H, d_k, d_v]``. Returns the outputs ``[B, H, T, d_v]`` and the
    final states. transformers' algorithm step for step: the intra-chunk system solved
    by forward substitution, the state stepped chunk by chunk."""
    B, H, T, dk = k.shape
    n = T // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, g, k_beta, v_beta = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, g, k_beta, v_beta))
    g = g.cumsum(dim=-2)
    diag = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(0)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf")).exp()
    system = -(k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(diag, 0)
    for i in range(1, chunk):
        row, sub = system[..., i, :i].clone(), system[..., :i, :i].clone()
        system[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    system = system + torch.eye(chunk, dtype=system.dtype, device=system.device)
    u = system @ v_beta
    w = system @ (k_beta * g.exp())
    state = initial
    out = torch.zeros_like(u)
    for i in range(n):
        q_i, k_i, g_i = q[:, :, i], k[:, :, i], g[:, :, i]
        inter = (q_i * g_i.exp()) @ state
        intra = (q_i.unsqueeze(-2) * k_i.unsqueeze(-3) * decay[:, :, i]).sum(dim=-1).masked_fill(upper, 0)
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = inter + intra @ v_new
        carried = (k_i * (g_i[:, :, -1:] - g_i).exp()).transpose(-1, -2)
        state = state * g_i[:, :, -1].exp().unsqueeze(-1) + carried @ v_new
    return out.reshape(B, H, T, -1), state


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's step (a decode step's, transformers' ``recurrent_kimi_delta_attention``
    for one token), float32: ``q``, ``k`` ``[B, H, d_k]`` (:func:`query_key`), ``v`` ``[B,
    H, d_v]``, ``g`` ``[B, H, d_k]``, ``beta`` ``[B, H]``, ``state`` ``[B, H, d_k, d_v]``
    -> the output ``[B, H, d_v]`` and the next state."""
    state = state * g.exp()[..., None]
    delta = (v - (state * k[..., None]).sum(dim=-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def kda_conv(x: torch.Tensor, halo: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The short convolutions (q, k and v channels, depthwise, SiLU) over blocks ``x``
    ``[B, T, C]`` after their ``K - 1`` rows ``halo`` (``weight`` ``[C, K]``), as
    transformers runs them: in the weight's dtype, then cast to ``x``'s. A weight in the
    model dtype is Gated DeltaNet's convolution (graphcp.model.hybrid.gdn.block_conv);
    GLM-5-Next keeps it in float32 (``_keep_in_fp32_modules``): the sums and the SiLU in
    float32, then rounded."""
    if weight.dtype == x.dtype:
        return block_conv(x, halo, weight)
    T, K = x.shape[1], weight.shape[1]
    ext = torch.cat([halo, x], dim=1).to(weight.dtype)
    out = ext[:, :T] * weight[:, 0]
    for j in range(1, K):
        out = out + ext[:, j:j + T] * weight[:, j]
    return F.silu(out).to(x.dtype)


def conv_step(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token's convolution (a decode step's): ``window`` ``[B, K, C]`` (the cached
    ``K - 1`` rows, oldest first, then the new row) -> ``[B, C]`` in the window's dtype,
    computed as :func:`kda_conv` does (transformers' ``causal_conv1d_update``)."""
    return kda_conv(window[:, -1:], window[:, :-1], weight)[:, 0]


def gated_norm(core: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``KimiLinearRMSNormGated``: each head's output normalised in float32, scaled by the
    float32 weight, times ``sigmoid(gate)`` in float32; the model dtype out."""
    x = core.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x * torch.sigmoid(gate.float())).to(core.dtype)
