"""A decode step's linear-layer kernels (graphcp.model.hybrid.step calls them on one row a
request): the torch reference (any device: transformers' ``torch_recurrent_gated_delta_rule``
and ``causal_conv1d_update`` for one token), or on CUDA, where the ``linear`` extra is
installed (``pip install -e ".[linear]"``), fla-core's fused recurrent rule and
causal-conv1d's update. A library is used where graphcp.model.hybrid.kernels's choice
imports it (one that is installed but broken is left out there, with its one note).

Both take the step's states gathered from the request's read slot and return the new
ones (the step writes them to the other slot: graphcp.model.hybrid.cache), so no kernel
writes the cache in place. The calls, bound to the libraries' source (fla-core 0.6.0,
causal-conv1d 1.7.0; tests/test_hybrid_decode_kernels.py binds them to the installed
functions where they import):

- ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule(q, k, v, g=..., beta=...,
  scale=d_k**-0.5, initial_state=..., output_final_state=True, use_qk_l2norm_in_kernel=True)``,
  as transformers calls it: ``q``, ``k`` ``[B, 1, Hk, d_k]`` and ``v`` ``[B, 1, Hv, V]`` in
  the model's dtype (the convolution's output; fla normalises q and k and maps value head
  ``i`` to key head ``i // (Hv / Hk)``), ``g`` (float32 log decays) and ``beta`` ``[B, 1,
  Hv]`` by keyword (the fourth to sixth parameters are ``g``, ``gk``, ``gv``),
  ``initial_state`` ``[B, Hv, d_k, V]`` float32 (read, not written); returns ``(o [B, 1,
  Hv, V]`` in v's dtype, ``final [B, Hv, d_k, V]`` float32, a new tensor). Its float32 sums
  are elementwise (no ``tl.dot``, so no TF32): a float32 model runs it too. No
  ``cu_seqlens``: one token a request.
- ``causal_conv1d.causal_conv1d_update(x, conv_state, weight, None, activation="silu")``:
  ``x`` ``[B, C]`` or ``[B, C, seqlen]`` (a verify step's n rows a request), ``conv_state``
  ``[B, C, state_len]`` of x's dtype (state_len >= K - 1; the request's last ``K`` rows
  here), ``weight`` ``[C, K]`` (K of 2 to 4); returns x's shape and shifts ``x`` into
  ``conv_state`` in place (a copy of the gathered state, here).

A verify step (n rows a request, graphcp.model.hybrid.step) keeps the state after each
row: fla-core 0.6's fused recurrent rule returns only a call's final state, so the rule
runs one call a row (``T = 1``, each from the previous call's state); the convolution runs
the n rows in one ``causal_conv1d_update`` call (``seqlen = n``), its per-row states being
windows of the rows it was given (copied on the torch side).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from graphcp.model.hybrid import kernels
from graphcp.model.hybrid.gdn import causal_conv, query_key

StepRule = Callable[..., tuple[torch.Tensor, torch.Tensor]]
StepConv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
StepConvRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StepKernels:
    """The two kernels of a linear layer's decode step."""

    name: str
    #: ``rule(q, k, v, g, beta, state)``: the convolution's ``q``, ``k`` ``[B, Hk, d_k]`` and
    #: ``v`` ``[B, Hv, d_v]`` (the model's dtype), float32 ``g``, ``beta`` ``[B, Hv]`` and
    #: ``state`` ``[B, Hv, d_k, d_v]`` -> ``(out [B, Hv, d_v], new float32 state)``
    rule: StepRule
    #: ``conv(x [B, C], state [B, K, C], weight [C, K])`` -> ``(out [B, C] (SiLU applied), new state)``
    conv: StepConv
    #: ``conv_rows(x [B, n, C], state [B, K, C], weight [C, K])`` -> ``out [B, n, C]``: n rows a
    #: request after its state, in order (a verify step's)
    conv_rows: StepConvRows


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule per request and value head, in float32, as
    transformers' recurrence (q and k normalised, q scaled, each key head serving its value
    heads): ``S = exp(g) S``, ``S += k (beta (v - S^T k))^T``, ``o = S^T q``."""
    q, k = query_key(q, k, v.shape[1] // k.shape[1])
    state = state * g.exp()[..., None, None]
    delta = (v.float() - (state * k[..., None]).sum(dim=-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def conv_rows_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The causal convolution of n new rows a request after its state: row i's window is
    the ``K - 1`` rows before it (the state's, then the earlier new rows) and the row."""
    full = torch.cat([state, x.to(state.dtype)], dim=1)  # [B, K + n, C]
    K, n = state.shape[1], x.shape[1]
    windows = torch.stack([full[:, i + 1: i + 1 + K] for i in range(n)], dim=1)  # [B, n, K, C]
    return causal_conv(windows.flatten(0, 1), weight).view(x.shape[0], n, -1)


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal convolution of one new row a request: its window is the state's last
    ``K - 1`` rows and the row, which is also the new state (transformers' ``causal_conv1d_update``)."""
    window = torch.cat([state[:, 1:], x[:, None].to(state.dtype)], dim=1)
    return causal_conv(window, weight), window


def fla_step_rule() -> StepRule:
    """fla-core's fused recurrent rule on one token a request (the call in the module doc)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla

    def rule(q, k, v, g, beta, state):
        o, final = fla(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g=g.unsqueeze(1),
                       beta=beta.to(v.dtype).unsqueeze(1), scale=q.shape[-1] ** -0.5, initial_state=state,
                       output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o[:, 0], final

    return rule


def causal_conv1d_step() -> StepConv:
    """causal-conv1d's update on one row a request, over a channel-major copy of the state."""
    from causal_conv1d import causal_conv1d_update

    def conv(x, state, weight):
        work = state.transpose(1, 2).contiguous()  # [B, C, K]: the kernel shifts x into it
        out = causal_conv1d_update(x.contiguous(), work, weight.contiguous(), None, activation="silu")
        return out, work.transpose(1, 2)

    return conv


def causal_conv1d_rows() -> StepConvRows:
    """causal-conv1d's update on n rows a request (``seqlen = n``), over a channel-major copy of the state."""
    from causal_conv1d import causal_conv1d_update

    def conv(x, state, weight):
        work = state.transpose(1, 2).contiguous()  # [B, C, K]
        out = causal_conv1d_update(x.transpose(1, 2).contiguous(), work, weight.contiguous(), None,
                                   activation="silu")
        return out.transpose(1, 2)

    return conv


TORCH_STEP = StepKernels("torch", recurrent_step, conv_step, conv_rows_step)


def select_step_kernels(device: torch.device) -> StepKernels:
    """On CUDA, fla-core's rule and causal-conv1d's update where the prefill's choice
    imports each library (graphcp.model.hybrid.kernels.load), else the torch reference's;
    the torch reference elsewhere."""
    if torch.device(device).type != "cuda":
        return TORCH_STEP
    fla, conv = (kernels.load(name)[0] is not None for name in ("fla-core", "causal-conv1d"))
    names = [n for n, ok in (("fla", fla), ("causal-conv1d", conv)) if ok]
    return StepKernels("+".join(names) or "torch", fla_step_rule() if fla else TORCH_STEP.rule,
                       causal_conv1d_step() if conv else TORCH_STEP.conv,
                       causal_conv1d_rows() if conv else TORCH_STEP.conv_rows)
