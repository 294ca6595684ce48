"""KDA's local kernels (graphcp.model.hybrid.scan calls them on padded blocks): the torch
reference (graphcp.model.kimi_linear.kda, any device), or on CUDA, where the ``linear``
extra is installed (``pip install -e ".[linear]"``), fla-core's ``chunk_kda`` and
causal-conv1d's ``causal_conv1d_fn`` (the hybrid family's binding,
graphcp.model.hybrid.kernels). Each library is imported only when its kernel is built;
:func:`select_kernels` takes each one that is there.

The calls, bound to fla-core 0.6's source (``fla/ops/kda/chunk.py``,
``fused_recurrent.py``; tests/test_kda_kernels.py binds them to the installed functions
where they import):

- ``fla.ops.kda.chunk_kda(q, k, v, g, beta, scale=1.0, initial_state=...,
  output_final_state=True)``: ``q``, ``k`` ``[B, T, H, K]`` (already l2-normalised, q
  scaled: ``scale=1.0``) and ``v`` ``[B, T, H, V]``, ``g`` ``[B, T, H, K]`` log decays
  (``use_gate_in_kernel=False``: precomputed), ``beta`` ``[B, T, H]``, ``initial_state``
  ``[B, H, K, V]`` float32 (fla asserts it); returns ``(o [B, T, H, V]`` in v's dtype,
  ``final [B, H, K, V]`` float32). The blocks are a batch of equal (padded) length: no
  ``cu_seqlens``. ``K <= 256``; the augmented state's ``V = d_k + d_v``.
- ``fla.ops.kda.fused_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=...,
  output_final_state=True)``: the same layouts for one token ``T = 1`` (a decode step's
  state step, :attr:`KdaKernels.step`).

Everything goes in float32, as the Gated DeltaNet path's does: the scan's augmented pass
returns each token's output as ``p S_in + o0``, and with the model's bfloat16 q/k/v (and
so a bfloat16 ``o``) those two terms round before they combine. Through fakes of fla's
contract at CP 2 that was 3.7e-2 from the torch path on the tests' tiny model (the
suite's bound: 2e-2); in float32 the kernels agree with it within 1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from graphcp.model.hybrid.kernels import LinearKernels, causal_conv1d_conv
from graphcp.model.kimi_linear.kda import chunk_kda, kda_conv, recurrent_kda

Step = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KdaKernels(LinearKernels):
    """The scan's two kernels (``rule``, ``conv``) and a decode step's state step."""

    #: ``step(q, k, v, g, beta, state)``: one token ``[B, H, d]`` -> ``(out [B, H, V], state)``
    step: Step = recurrent_kda


TORCH = KdaKernels("torch", chunk_kda, kda_conv, recurrent_kda)


def fla_rule():
    """fla-core's ``chunk_kda`` on graphcp's ``[B, H, T, d]`` float32 blocks (transposed to
    fla's ``[B, T, H, d]`` and back)."""
    from fla.ops.kda import chunk_kda as fla

    def rule(q, k, v, g, beta, initial):
        o, final = fla(*(x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta)), scale=1.0,
                       initial_state=initial.contiguous(), output_final_state=True)
        return o.transpose(1, 2), final

    return rule


def fla_step() -> Step:
    """fla-core's ``fused_recurrent_kda`` for one float32 token ``[B, H, d]`` (a decode step)."""
    from fla.ops.kda import fused_recurrent_kda as fla

    def step(q, k, v, g, beta, state):
        o, final = fla(*(x[:, None].contiguous() for x in (q, k, v, g, beta)), scale=1.0,
                       initial_state=state.contiguous(), output_final_state=True)
        return o[:, 0], final

    return step


def _built(build: Callable[[], Callable], fallback: Callable) -> tuple[Callable, bool]:
    """A kernel whose library imports (its import is the build), else the fallback."""
    try:
        return build(), True
    except ImportError:
        return fallback, False


def select_kernels(device: torch.device) -> KdaKernels:
    """On CUDA: fla-core's ``chunk_kda`` (and its recurrent step) and causal-conv1d's
    convolution where they import (each on its own), else the torch reference; the torch
    reference elsewhere."""
    if torch.device(device).type != "cuda":
        return TORCH
    rule, fla = _built(fla_rule, TORCH.rule)
    conv, c1d = _built(causal_conv1d_conv, TORCH.conv)
    if not (fla or c1d):
        return TORCH
    names = [n for n, ok in (("fla", fla), ("causal-conv1d", c1d)) if ok]
    return KdaKernels("+".join(names), rule, conv, fla_step() if fla else TORCH.step)
