"""The linear layers' local kernels (graphcp.model.hybrid.scan calls them on padded
blocks): the torch reference (graphcp.model.hybrid.gdn, any device), or on CUDA, where
the ``linear`` extra is installed (``pip install -e ".[linear]"``), fla-core's chunked
gated delta rule and causal-conv1d's convolution. Each library is imported only when
its kernel is built; :func:`select_kernels` takes each one that is there.

The calls, bound to the libraries' source (fla-core 0.6, causal-conv1d 1.7;
tests/test_hybrid_kernels.py binds them to the installed functions where they import):

- ``fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0,
  initial_state=..., output_final_state=True)``: ``q``, ``k`` ``[B, T, H, K]`` (already
  l2-normalised, q scaled: ``scale=1.0``), ``v`` ``[B, T, H, V]``, ``g`` (log decays) and
  ``beta`` ``[B, T, H]``, ``initial_state`` ``[B, H, K, V]``; returns ``(o [B, T, H, V],
  final [B, H, K, V])``. The blocks are a batch of equal (padded) length: no
  ``cu_seqlens``, so nothing is read back to the host. ``K <= 256``.
- ``causal_conv1d.causal_conv1d_fn(x, weight, None, None, initial_states, activation="silu")``:
  ``x`` ``[B, C, T]`` channel-last (stride 1 along C), ``weight`` ``[C, K]``,
  ``initial_states`` ``[B, C, K - 1]`` channel-last (the halo); returns ``[B, C, T]``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from graphcp.model.hybrid.gdn import block_conv, chunk_gated_delta_rule

Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Conv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LinearKernels:
    """The two kernels of a linear layer's local pass (layouts: graphcp.model.hybrid.gdn's)."""

    name: str
    #: ``rule(q, k, v, g, beta, initial)``: ``[B, H, T, d]`` blocks -> ``(out [B, H, T, V], final)``
    rule: Rule
    #: ``conv(x [B, T, C], halo [B, K-1, C], weight [C, K])`` -> ``[B, T, C]`` (SiLU applied)
    conv: Conv


def fla_rule() -> Rule:
    """fla-core's chunked rule on graphcp's ``[B, H, T, d]`` blocks (transposed to fla's
    ``[B, T, H, d]`` and back)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla

    def rule(q, k, v, g, beta, initial):
        o, final = fla(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
                       g.transpose(1, 2).contiguous(), beta.transpose(1, 2).contiguous(), scale=1.0,
                       initial_state=initial.contiguous(), output_final_state=True)
        return o.transpose(1, 2), final

    return rule


def causal_conv1d_conv() -> Conv:
    """causal-conv1d's kernel on graphcp's ``[B, T, C]`` blocks (channel-last views)."""
    from causal_conv1d import causal_conv1d_fn

    def conv(x, halo, weight):
        out = causal_conv1d_fn(x.contiguous().transpose(1, 2), weight.contiguous(), None, None,
                               halo.contiguous().transpose(1, 2), activation="silu")
        return out.transpose(1, 2)

    return conv


TORCH = LinearKernels("torch", chunk_gated_delta_rule, block_conv)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def select_kernels(device: torch.device) -> LinearKernels:
    """On CUDA: fla-core's rule and causal-conv1d's convolution where installed (each on
    its own), else the torch reference; the torch reference elsewhere."""
    if torch.device(device).type != "cuda":
        return TORCH
    fla, conv = _importable("fla"), _importable("causal_conv1d")
    if not (fla or conv):
        return TORCH
    names = [n for n, ok in (("fla", fla), ("causal-conv1d", conv)) if ok]
    return LinearKernels("+".join(names), fla_rule() if fla else TORCH.rule,
                         causal_conv1d_conv() if conv else TORCH.conv)
