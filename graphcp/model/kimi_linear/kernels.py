"""KDA's local kernels (graphcp.model.hybrid.scan calls them on a rank's blocks as one
variable-length batch, graphcp.model.hybrid.varlen): the torch reference
(graphcp.model.kimi_linear.kda, any device), or on CUDA, where the ``linear`` extra is
installed (``pip install -e ".[linear]"``), fla-core's ``chunk_kda`` and causal-conv1d's
convolution (the Gated DeltaNet family's binding, graphcp.model.hybrid.kernels). A library
installed but broken is left out with the hybrid family's one-line note.

The calls, bound to fla-core 0.6.0's source (``fla/ops/kda/chunk.py``,
``fused_recurrent.py``; tests/test_kda_kernels.py binds them where fla imports):

- ``fla.ops.kda.chunk_kda(q, k, v, g, beta, scale=d**-0.5, initial_state=...,
  output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=...,
  cu_seqlens_cpu=...)``, as transformers calls it: ``q``, ``k``, ``v`` ``[1, n, H, d]`` in
  the model's dtype (the convolution's output; fla normalises q and k), ``g`` ``[1, n, H,
  d]`` float32 per-channel log decays (``use_gate_in_kernel=False``: precomputed),
  ``beta`` ``[1, n, H]``, ``initial_state`` ``[nb, H, d, V]`` float32 (fla asserts it);
  returns ``(o [1, n, H, V]`` in v's dtype, ``final [nb, H, d, V]`` float32). The blocks
  are one varlen batch; with ``cu_seqlens_cpu`` fla builds its chunk indices on the host.
- ``fla.ops.kda.fused_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=...,
  output_final_state=True)``: one float32 token ``[B, 1, H, d]``, q and k already
  normalised (a decode step's state step, :attr:`KdaKernels.step`).

**Precision** as the Gated DeltaNet path's: a bfloat16 model runs fla on its q/k/v with a
float32 state, and the scan takes the outputs from a second pass from the composed
states (fla's outputs are in the model's dtype); a float32 model runs the torch rule.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass, replace
from typing import Callable

import torch

from graphcp.model.hybrid import kernels as hybrid
from graphcp.model.hybrid import step_kernels as hybrid_step
from graphcp.model.hybrid.kernels import ConvKernel, LinearKernels, RuleKernel
from graphcp.model.hybrid.step_kernels import StepKernels
from graphcp.model.hybrid.varlen import ChunkSlots, FlaSegments
from graphcp.model.kimi_linear.kda import conv_step, kda_conv_rows, query_key, recurrent_kda, varlen_kda

Step = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def torch_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial: torch.Tensor, slots: ChunkSlots) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference in float32: q/k normalised and scaled (transformers' form), then
    :func:`~graphcp.model.kimi_linear.kda.varlen_kda`."""
    q, k = query_key(q, k)
    return varlen_kda(q, k, v.float(), g, beta, initial, slots)


TORCH_RULE = RuleKernel("torch", torch_rule, "slots", True)
TORCH_CONV = ConvKernel("torch", kda_conv_rows, False)


@dataclass(frozen=True)
class KdaKernels(LinearKernels):
    """The scan's two kernels, and a decode step's state step."""

    #: ``step(q, k, v, g, beta, state)``: one token ``[B, H, d]`` -> ``(out [B, H, V], state)``
    step: Step = recurrent_kda

    def for_dtype(self, dtype: torch.dtype) -> "KdaKernels":
        """A float32 model runs the torch rule (graphcp.model.hybrid.kernels' reason)."""
        return replace(self, rule=TORCH_RULE) if dtype == torch.float32 else self


TORCH = KdaKernels(TORCH_RULE, TORCH_CONV)


def fla_rule() -> RuleKernel:
    """fla-core's ``chunk_kda`` on the varlen rows (the call in the module doc)."""
    from fla.ops.kda import chunk_kda as fla

    def rule(q, k, v, g, beta, initial, seg: FlaSegments):
        o, final = fla(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0),
                       beta.to(v.dtype).unsqueeze(0), scale=q.shape[-1] ** -0.5, initial_state=initial,
                       output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=seg.cu_seqlens,
                       cu_seqlens_cpu=seg.cu_seqlens_cpu)
        return o[0], final

    return RuleKernel("fla", rule, "segments", False)


def fla_step() -> Step:
    """fla-core's ``fused_recurrent_kda`` for one float32 token ``[B, H, d]`` (a decode step)."""
    from fla.ops.kda import fused_recurrent_kda as fla

    def step(q, k, v, g, beta, state):
        o, final = fla(*(x[:, None].contiguous() for x in (q, k, v, g, beta)), scale=1.0,
                       initial_state=state.contiguous(), output_final_state=True)
        return o[:, 0], final

    return step


def fla_installed() -> bool:
    try:
        return importlib.util.find_spec("fla") is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def load_fla() -> tuple[RuleKernel | None, Step | None, str | None]:
    """fla-core's KDA kernels (None where fla is not installed or does not import) and, for
    an installed but broken one, the note said once on stderr."""
    if not fla_installed():
        return None, None, None
    try:
        return fla_rule(), fla_step(), None
    except Exception as e:  # noqa: BLE001 - any import failure (ImportError, OSError, a torch ABI RuntimeError)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        why = f"{type(e).__name__}: {first}" if first else type(e).__name__
        note = f"graphcp: note: fla-core is installed but does not import ({why}); KDA runs the torch reference"
        print(note, file=sys.stderr, flush=True)
        return None, None, note


def choose_kernels() -> KdaKernels:
    """The CUDA choice: fla's KDA kernels and causal-conv1d's convolution where each imports."""
    rule, step, rule_note = load_fla()
    conv, conv_note = hybrid.load("causal-conv1d")
    notes = tuple(n for n in (rule_note, conv_note) if n)
    return KdaKernels(rule or TORCH_RULE, conv or TORCH_CONV, notes, step or recurrent_kda)


def select_kernels(device: torch.device) -> KdaKernels:
    """On CUDA :func:`choose_kernels`; the torch reference elsewhere."""
    return choose_kernels() if torch.device(device).type == "cuda" else TORCH


def step_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's convolution of one new row a request (the hybrid step's ``conv``
    contract): the window is the state's last ``K - 1`` rows and the row, which is also the
    new state; convolved as transformers' ``causal_conv1d_update`` (:func:`~graphcp.model.
    kimi_linear.kda.conv_step`: a float32 weight's sums in float32)."""
    window = torch.cat([state[:, 1:], x[:, None].to(state.dtype)], dim=1)
    return conv_step(window, weight), window


def step_kernels(kernels: KdaKernels) -> StepKernels:
    """A KDA layer's decode step as the hybrid step (graphcp.model.hybrid.step) calls it:
    q and k normalised and scaled (transformers' ``use_qk_l2norm_in_kernel``), then
    ``kernels.step`` on float32 rows (the torch step or fla's ``fused_recurrent_kda``), and
    the convolution's step (:func:`step_conv`, causal-conv1d's update where the prefill's
    choice took causal-conv1d)."""
    step = kernels.step

    def rule(q, k, v, g, beta, state):
        q, k = query_key(q, k)
        return step(q, k, v.float(), g, beta, state)

    conv = None
    if kernels.conv.name != "torch":
        try:
            conv = hybrid_step.causal_conv1d_step()
        except ImportError:  # a causal-conv1d without the update: the torch step
            conv = None
    names = [n for n, on in (("fla", step is not recurrent_kda), ("causal-conv1d", conv is not None)) if on]
    conv = conv or step_conv

    def conv_rows(x, state, weight):  # n rows a request in order (the step's contract; no KDA draft uses it)
        outs = []
        for j in range(x.shape[1]):
            out, state = conv(x[:, j], state, weight)
            outs.append(out)
        return torch.stack(outs, dim=1)

    return StepKernels("+".join(names) or "torch", rule, conv, conv_rows)
