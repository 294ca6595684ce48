"""A decode step's linear-layer kernels (graphcp.model.hybrid.step calls them on one row a
request): the torch reference (any device: transformers' ``torch_recurrent_gated_delta_rule``
and ``causal_conv1d_update`` for one token), or on CUDA, where the ``linear`` extra is
installed (``pip install -e ".[linear]"``), fla-core's fused recurrent rule and
causal-conv1d's update. Each library is imported only when its kernel is built;
:func:`select_step_kernels` takes each one that is there.

Both take the step's states gathered from the request's read slot and return the new
ones (the step writes them to the other slot: graphcp.model.hybrid.cache), so no kernel
writes the cache in place. The calls, bound to the libraries' source (fla-core 0.6,
causal-conv1d 1.7; tests/test_hybrid_decode_kernels.py binds them to the installed
functions where they import):

- ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule(q, k, v, g=..., beta=...,
  scale=1.0, initial_state=..., output_final_state=True)``: ``q``, ``k`` ``[B, 1, H, K]``
  (already l2-normalised, q scaled), ``v`` ``[B, 1, H, V]``, ``g`` (log decays) and ``beta``
  ``[B, 1, H]`` by keyword (the fourth to sixth parameters are ``g``, ``gk``, ``gv``),
  ``initial_state`` ``[B, H, K, V]`` float32; returns ``(o [B, 1, H, V], final [B, H, K,
  V] float32)``, a new final state. Contiguous inputs; no ``cu_seqlens`` (equal lengths).
- ``causal_conv1d.causal_conv1d_update(x, conv_state, weight, None, activation="silu")``:
  ``x`` ``[B, C]``, ``conv_state`` ``[B, C, state_len]`` (state_len >= K - 1; the request's
  last ``K`` rows here, the x dtype), ``weight`` ``[C, K]``; returns ``[B, C]`` and shifts
  ``x`` into ``conv_state`` in place (a copy of the gathered state, here).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from graphcp.model.hybrid.gdn import causal_conv

StepRule = Callable[..., tuple[torch.Tensor, torch.Tensor]]
StepConv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class StepKernels:
    """The two kernels of a linear layer's decode step."""

    name: str
    #: ``rule(q, k, v, g, beta, state)``: float32 ``[B, H, d]`` rows, ``g``, ``beta`` ``[B, H]``,
    #: ``state`` ``[B, H, d_k, d_v]`` -> ``(out [B, H, d_v], new state)``
    rule: StepRule
    #: ``conv(x [B, C], state [B, K, C], weight [C, K])`` -> ``(out [B, C] (SiLU applied), new state)``
    conv: StepConv


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule per request and value head (transformers'
    recurrence, step for step): ``S = exp(g) S``, ``S += k (beta (v - S^T k))^T``,
    ``o = S^T q``."""
    state = state * g.exp()[..., None, None]
    delta = (v - (state * k[..., None]).sum(dim=-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal convolution of one new row a request: its window is the state's last
    ``K - 1`` rows and the row, which is also the new state (transformers' ``causal_conv1d_update``)."""
    window = torch.cat([state[:, 1:], x[:, None].to(state.dtype)], dim=1)
    return causal_conv(window, weight), window


def fla_step_rule() -> StepRule:
    """fla-core's fused recurrent rule on one token a request."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla

    def rule(q, k, v, g, beta, state):
        o, final = fla(q[:, None].contiguous(), k[:, None].contiguous(), v[:, None].contiguous(),
                       g=g[:, None].contiguous(), beta=beta[:, None].contiguous(), scale=1.0,
                       initial_state=state.contiguous(), output_final_state=True)
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


TORCH_STEP = StepKernels("torch", recurrent_step, conv_step)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def select_step_kernels(device: torch.device) -> StepKernels:
    """On CUDA: fla-core's rule and causal-conv1d's update where installed (each on its
    own), else the torch reference; the torch reference elsewhere."""
    if torch.device(device).type != "cuda":
        return TORCH_STEP
    fla, conv = _importable("fla"), _importable("causal_conv1d")
    if not (fla or conv):
        return TORCH_STEP
    names = [n for n, ok in (("fla", fla), ("causal-conv1d", conv)) if ok]
    return StepKernels("+".join(names), fla_step_rule() if fla else TORCH_STEP.rule,
                       causal_conv1d_step() if conv else TORCH_STEP.conv)
