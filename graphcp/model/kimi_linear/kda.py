"""Kimi Delta Attention's math, the torch reference (ported from transformers' fallbacks in
``modeling_kimi_linear.py`` / ``modeling_glm5_next.py``: ``chunk_kimi_delta_attention``,
``recurrent_kimi_delta_attention``, ``KimiLinearForgetGate``, ``KimiLinearRMSNormGated``),
on *blocks* (runs of consecutive tokens of one request): padded to whole chunks
(:func:`chunk_kda`, transformers' form) or as one variable-length batch of rows
(:func:`varlen_kda`, :func:`kda_conv_rows`: what graphcp.model.hybrid.scan runs).

KDA is the gated delta rule with a decay per key channel instead of per head: per head
the state ``S`` (``[d_k, d_v]``, float32) is

    S_t = (I - b_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,    o_t = q_t^T S_t

with ``g_t`` a ``d_k`` vector of log decays. It is still affine in ``S_{t-1}``, so a block
maps its incoming state as ``S_out = X S_in + Y`` and the augmented pass of
graphcp.model.hybrid.gdn (``augmented_rule``) and the scan across ranks apply unchanged:
:func:`varlen_kda` is the torch ``rule`` they call (graphcp.model.kimi_linear.kernels).

Padding rows (past a block's length) have ``q = k = v = 0``, ``b = 0`` and ``g = 0``: the
state passes through them unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphcp.model.hybrid.gdn import CHUNK, block_conv, conv_rows, varlen_chunks
from graphcp.model.hybrid.varlen import ChunkSlots, ConvRows

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


#: the sub-chunk of the intra-chunk scores: pairs in one sub-chunk take
#: transformers' direct per-pair decay; pairs across sub-chunks two matmuls' factors
SUB = 8


def _pair_scores(rows: tuple[torch.Tensor, ...], cols: torch.Tensor, g: torch.Tensor, sub: int = SUB
                 ) -> list[torch.Tensor]:
    """``sum_c a[i, c] cols[j, c] exp(g[i, c] - g[j, c])`` for ``j <= i`` (else 0), each
    ``a`` of ``rows`` ``[..., C, d]`` (``g`` the chunk's cumulative log decays, so the
    exponent is <= 0). transformers forms the ``[C, C, d]`` decay tensor; here a pair in
    one sub-chunk takes it directly ``[sub, sub, d]``, and a pair across sub-chunks splits
    it at the row sub-chunk's first token ``r``: ``exp(g_i - g_r) exp(g_r - g_j)``, both
    exponents <= 0 (no overflow; a factor that underflows bounds a product that does), so
    a matmul sums it. The same sums as transformers' within float32 rounding, ``C / sub``
    times fewer decay terms."""
    C = g.shape[-2]
    m = C // sub
    gs = g.unflatten(-2, (m, sub))  # [..., m, sub, d]
    ref = gs[..., :1, :]
    before = torch.arange(C, device=g.device) < (torch.arange(m, device=g.device) * sub)[:, None]  # [m, C]
    col = cols.unsqueeze(-3) * (ref - g.unsqueeze(-3)).masked_fill(~before[..., None], float("-inf")).exp()
    col = col.transpose(-1, -2)  # [..., m, d, C]: column j < r's sub-chunk, decayed from j to r
    upper = torch.ones(sub, sub, dtype=torch.bool, device=g.device).triu(1)
    decay = (gs.unsqueeze(-2) - gs.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf")).exp()
    decayed = cols.unflatten(-2, (m, sub)).unsqueeze(-3) * decay  # [..., m, sub (i), sub (j), d]
    from_ref = (gs - ref).exp()  # a row decayed from its sub-chunk's first token
    out = []
    for a in rows:
        a_s = a.unflatten(-2, (m, sub))
        scores = (a_s * from_ref) @ col  # [..., m, sub, C]: 0 from r's sub-chunk on
        own = (a_s.unsqueeze(-2) * decayed).sum(dim=-1)  # [..., m, sub, sub]
        torch.diagonal(scores.unflatten(-1, (m, sub)), dim1=-4, dim2=-2).copy_(own.movedim(-3, -1))
        out.append(scores.flatten(-3, -2))
    return out


def _chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 chunk: int) -> tuple[torch.Tensor, ...]:
    """The chunked rule's per-chunk terms of ``[B, H, T, d]`` inputs (``T`` a multiple of
    ``chunk``), each ``[B, H, n, ...]``: the decayed queries and keys, ``u``, ``w``, the
    intra-chunk scores and each chunk's total decay per key channel (transformers'
    algorithm: the intra-chunk system solved by forward substitution; the pair scores
    by :func:`_pair_scores`)."""
    B, H, T, dk = k.shape
    n = T // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, g, k_beta, v_beta = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, g, k_beta, v_beta))
    g = g.cumsum(dim=-2)
    diag = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(0)
    beta_scores, intra = _pair_scores((k_beta, q), k, g)
    system = -beta_scores.masked_fill(diag, 0)
    for i in range(1, chunk):
        row, sub = system[..., i, :i].clone(), system[..., :i, :i].clone()
        system[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    system = system + torch.eye(chunk, dtype=system.dtype, device=system.device)
    u = system @ v_beta
    w = system @ (k_beta * g.exp())
    last = g[..., -1:, :]
    return q * g.exp(), k * (last - g).exp(), u, w, intra, last.exp().transpose(-1, -2)


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked KDA rule over ``B`` blocks at once (float32): ``q``, ``k`` ``[B, H, T,
    d_k]`` (normalised, :func:`query_key`), ``v`` ``[B, H, T, d_v]``, ``g`` ``[B, H, T,
    d_k]`` (log decays), ``beta`` ``[B, H, T]``, ``T`` a multiple of ``chunk``, each block
    from ``initial`` ``[B, H, d_k, d_v]``. Returns the outputs ``[B, H, T, d_v]`` and the
    final states (transformers' ``chunk_kimi_delta_attention`` within float32 rounding:
    :func:`_pair_scores`)."""
    B, H, T, _ = k.shape
    q, k, u, w, intra, decay = _chunk_terms(q, k, v, g, beta, chunk)
    state = initial
    out = torch.zeros_like(u)
    for i in range(T // chunk):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(B, H, T, -1), state


def varlen_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial: torch.Tensor, slots: ChunkSlots, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_kda` over a variable-length batch of blocks (float32 rows ``q``, ``k``
    ``[n, H, d_k]``, ``v`` ``[n, H, d_v]``, ``g`` ``[n, H, d_k]``, ``beta`` ``[n, H]``;
    block ``b`` from ``initial[b]``), each block padded to whole chunks only
    (graphcp.model.hybrid.varlen's :class:`ChunkSlots`, as the Gated DeltaNet rule's
    ``varlen_gated_delta_rule``). Returns the outputs ``[n, H, d_v]`` and the final
    states ``[nb, H, d_k, d_v]``."""
    return varlen_chunks(_chunk_terms, q, k, v, g, beta, initial, slots, chunk)


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


def kda_conv_rows(source: torch.Tensor, rows: ConvRows, weight: torch.Tensor) -> torch.Tensor:
    """The short convolutions of every live row over the blocks' extended rows (what the
    scan calls, graphcp.model.hybrid.varlen's :class:`ConvRows`): Gated DeltaNet's
    (graphcp.model.hybrid.gdn.conv_rows) for a weight in the rows' dtype; a float32
    weight over model-dtype rows as :func:`kda_conv` (the SiLU in float32, then rounded)."""
    if weight.dtype == source.dtype:
        return conv_rows(source, rows, weight)
    K = weight.shape[1]
    ext = source.index_select(0, rows.ext).to(weight.dtype)
    L = ext.shape[0] - (K - 1)
    out = ext[:L] * weight[:, 0]
    for j in range(1, K):
        out = out + ext[j:j + L] * weight[:, j]
    return F.silu(out.index_select(0, rows.outputs())).to(source.dtype)


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
