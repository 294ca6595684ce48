"""Gated DeltaNet's math, the torch reference (ported from transformers' fallbacks in
``modeling_qwen3_5.py``: ``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn``,
``Qwen3_5RMSNormGated``), on a batch of *blocks*: runs of consecutive tokens of one
request each, either padded to a whole number of chunks (:func:`chunk_gated_delta_rule`,
transformers' own form) or as one variable-length batch of rows
(:func:`varlen_gated_delta_rule`, :func:`conv_rows`: what a forward runs).

Per value head the recurrence on the state ``S`` (``[d_k, d_v]``, float32) is

    S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,    o_t = q_t^T S_t

so a block maps its incoming state affinely, ``S_out = A S_in + B``. Running a block
with the *augmented* state ``[X | Y]`` (``d_k x (d_k + d_v)``, values ``[0 | v]``) from
``[I | 0]`` gives ``X = A`` and ``Y = B`` at its end and, at every token,
``o_t = p_t S_in + o0_t`` where ``[p_t | o0_t]`` is the augmented output: the block's
outputs for any incoming state follow from one pass (docs/hybrid.md). A block whose
incoming state is known (a request's first block: its cached prefix's state, or zero)
runs from ``[0 | S_in]``: then ``X = 0``, ``p_t = 0`` and ``Y`` is its true final state.

Padding rows (past a block's length, up to its chunk's end) have ``q = k = v = 0``,
``b = 0`` and ``g = 0``: they leave the state as it is, so a padded block's final state
is its true one.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from graphcp.model.hybrid.varlen import ChunkSlots, ConvRows

#: tokens a chunk of the chunked rule holds (transformers' and fla's default)
CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and fla's) l2norm: ``x * rsqrt(sum(x^2) + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def decay_and_beta(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(g, beta)`` of rows ``b``, ``a`` ``[n, Hv]`` (model dtype), as
    transformers computes them: ``g = -exp(A_log) softplus(a + dt_bias)`` (log decay,
    <= 0), ``beta = sigmoid(b)`` (in the model dtype, then float32)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid().float()


def query_key(q: torch.Tensor, k: torch.Tensor, repeat: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 queries and keys ``[..., Hv, d_k]`` of ``[..., Hk, d_k]``: each key head
    serves ``repeat`` consecutive value heads; l2-normalised, queries scaled by
    ``d_k^-0.5`` (transformers' ``use_qk_l2norm_in_kernel``)."""
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def _chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 chunk: int) -> tuple[torch.Tensor, ...]:
    """The chunked rule's per-chunk terms of ``[B, H, T, d]`` inputs (``T`` a multiple of
    ``chunk``), each ``[B, H, n, ...]``: the decayed queries and keys, ``u``, ``w``, the
    intra-chunk scores and each chunk's total decay (transformers' algorithm, step for step)."""
    B, H, T, dk = k.shape
    n = T // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(B, H, n, chunk).cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    decay = cum[..., -1].exp()[..., None, None]
    return q, k, u, w, intra, decay


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule over ``B`` blocks at once (float32): ``q``, ``k``
    ``[B, H, T, d_k]`` (normalised, :func:`query_key`), ``v`` ``[B, H, T, d_v]``, ``g``,
    ``beta`` ``[B, H, T]``, ``T`` a multiple of ``chunk``, each block starting from
    ``initial`` ``[B, H, d_k, d_v]``. Returns the outputs ``[B, H, T, d_v]`` and the
    final states ``[B, H, d_k, d_v]``. The chunks' intra-chunk terms run in parallel, the
    state steps chunk by chunk (transformers' algorithm, step for step)."""
    B, H, T, dk = k.shape
    q, k, u, w, intra, decay = _chunk_terms(q, k, v, g, beta, chunk)
    state = initial
    out = torch.empty_like(u)
    for i in range(T // chunk):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(B, H, T, -1), state


def varlen_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            initial: torch.Tensor, slots: ChunkSlots, chunk: int = CHUNK
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_gated_delta_rule` over a variable-length batch of blocks (float32 rows
    ``q``, ``k`` ``[n, H, d_k]``, ``v`` ``[n, H, d_v]``, ``g``, ``beta`` ``[n, H]``; block
    ``b`` from ``initial[b]``), each block padded to a whole number of chunks only
    (graphcp.model.hybrid.varlen's :class:`ChunkSlots`): the intra-chunk terms of every
    chunk at once, then step ``i`` advances the blocks that have an ``i``-th chunk. Returns
    the outputs ``[n, H, d_v]`` and the final states ``[nb, H, d_k, d_v]``."""
    return varlen_chunks(_chunk_terms, q, k, v, g, beta, initial, slots, chunk)


def varlen_chunks(chunk_terms: Callable[..., tuple[torch.Tensor, ...]], q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial: torch.Tensor, slots: ChunkSlots,
                  chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The varlen chunked delta rule with a rule's own intra-chunk terms (``chunk_terms``:
    Gated DeltaNet's per-head decay here, KDA's per-channel one in ``kimi_linear/kda.py``;
    the inter-chunk step is affine in the state either way): the terms of every chunk at
    once, then step ``i`` advances the blocks that have an ``i``-th chunk."""
    n, H = v.shape[:2]
    S = slots.rows.shape[0] // chunk
    if S == 0:
        return v.new_zeros(n, H, v.shape[-1]), initial.clone()

    def chunks(x: torch.Tensor) -> torch.Tensor:  # rows -> [S, H, 1, chunk, ...] (a zero row past a block)
        rows = torch.cat([x, x.new_zeros(1, *x.shape[1:])]).index_select(0, slots.rows)
        return rows.view(S, chunk, *x.shape[1:]).movedim(1, 2)

    q, k, u, w, intra, decay = (t[:, :, 0] for t in chunk_terms(*(chunks(x) for x in (q, k, v, g, beta)), chunk))
    state = initial.index_select(0, slots.order)
    out = torch.empty_like(u)
    for i in range(len(slots.steps) - 1):
        a, b = slots.steps[i], slots.steps[i + 1]
        now = state[: b - a]
        v_new = u[a:b] - w[a:b] @ now
        out[a:b] = q[a:b] @ now + intra[a:b] @ v_new
        state[: b - a] = now * decay[a:b] + k[a:b].transpose(-1, -2) @ v_new
    flat = out.movedim(1, 2).reshape(S * chunk, H, -1)
    return flat.index_select(0, slots.position), state.index_select(0, slots.inverse)


def augmented_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   initial: torch.Tensor, known: torch.Tensor, rule: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every block's outputs for any incoming state, in one pass (module doc), over a
    variable-length batch of rows: ``v`` ``[n, Hv, d_v]``, ``initial`` ``[nb, Hv, d_k,
    d_v]`` (float32), ``known`` ``[nb]`` bool: the block's incoming state is ``initial``
    (else unknown: ``initial`` is ignored); ``rule(q, k, values, g, beta, states)``: the
    chunked rule over the blocks (graphcp.model.hybrid.kernels), ``q``/``k`` passed as
    given. Returns ``(p, o0, X, Y)``: ``p`` ``[n, Hv, d_k]``, ``o0`` ``[n, Hv, d_v]`` (a
    token's output is ``p S_in + o0``), and the blocks' maps ``S_out = X S_in + Y``."""
    B, H, dk = initial.shape[:3]
    eye = torch.eye(dk, dtype=initial.dtype, device=initial.device).expand(B, H, dk, dk)
    x0 = torch.where(known[:, None, None, None], torch.zeros_like(eye), eye)
    y0 = torch.where(known[:, None, None, None], initial, torch.zeros_like(initial))
    values = torch.cat([v.new_zeros(*v.shape[:-1], dk), v], dim=-1)
    out, final = rule(q, k, values, g, beta, torch.cat([x0, y0], dim=-1))
    return out[..., :dk], out[..., dk:], final[..., :dk], final[..., dk:]


def conv_rows(source: torch.Tensor, rows: ConvRows, weight: torch.Tensor) -> torch.Tensor:
    """The depthwise causal convolution and its SiLU of each live row (graphcp.model.hybrid.varlen's
    :class:`ConvRows`: every block's halo then its rows, as rows of ``source`` ``[*,
    channels]``; ``weight`` ``[channels, K]``): :func:`block_conv` over the blocks' extended
    sequence as one (slices, no gather a tap; a window that straddles two blocks belongs to
    a halo row and is dropped), then the live rows' outputs: its results bit for bit."""
    K = weight.shape[1]
    ext = source.index_select(0, rows.ext).float()
    w = weight.float()
    L = ext.shape[0] - (K - 1)
    out = ext[:L] * w[:, 0]
    for j in range(1, K):
        out = out + ext[j:j + L] * w[:, j]
    return F.silu(out.index_select(0, rows.outputs()).to(source.dtype))


def block_conv(x: torch.Tensor, halo: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The depthwise causal convolution and its SiLU over blocks ``x`` ``[B, T, channels]``
    whose ``K - 1`` preceding rows are ``halo`` ``[B, K - 1, channels]`` (``weight``
    ``[channels, K]``): float32 sums rounded to ``x``'s dtype, then the SiLU in it (as
    ``F.conv1d`` and ``silu`` in the model dtype give them)."""
    T, K = x.shape[1], weight.shape[1]
    ext = torch.cat([halo, x], dim=1).float()
    w = weight.float()
    out = ext[:, :T] * w[:, 0]
    for j in range(1, K):
        out = out + ext[:, j:j + T] * w[:, j]
    return F.silu(out.to(x.dtype))


def causal_conv(windows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The depthwise causal convolution and its SiLU over each row's window ``[n, K,
    channels]`` (the row's ``K - 1`` predecessors, oldest first, then the row itself):
    ``weight`` ``[channels, K]``; float32 sums rounded to the windows' dtype, then the SiLU
    in it (as ``F.conv1d`` and ``silu`` in the model dtype give them)."""
    out = (windows.float() * weight.t().float()).sum(dim=1)
    return F.silu(out.to(windows.dtype))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3_5RMSNormGated``: normalise ``x`` per head in float32, scale by ``weight``
    in the model dtype, times ``silu(gate)`` in float32; the model dtype out."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * xf.to(dtype)) * F.silu(gate.float())).to(dtype)
