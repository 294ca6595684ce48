"""The linear layers' local kernels (graphcp.model.hybrid.scan calls them on a rank's
blocks as one variable-length batch, graphcp.model.hybrid.varlen): the torch reference
(graphcp.model.hybrid.gdn, any device), or on CUDA, where the ``linear`` extra is
installed (``pip install -e ".[linear]"``), fla-core's chunked gated delta rule and
causal-conv1d's convolution. :func:`select_kernels` imports each library inside the
choice and takes each one that imports; one that is installed but does not import (a
build for another torch: an undefined symbol) is left out with a one-line note on stderr.

The calls, bound to the libraries' source (fla-core 0.6.0, causal-conv1d 1.7.0;
tests/test_hybrid_kernels.py binds them to the installed functions where they import):

- ``fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, scale=d_k**-0.5,
  initial_state=..., output_final_state=True, use_qk_l2norm_in_kernel=True,
  cu_seqlens=..., cu_seqlens_cpu=..., chunk_indices=...)``, as transformers calls it:
  ``q``, ``k`` ``[1, n, Hk, d_k]`` and ``v`` ``[1, n, Hv, V]`` in the model's dtype (the
  convolution's output; fla normalises q and k and maps value head ``i`` to key head
  ``i // (Hv / Hk)``, transformers' repeat), ``g`` (float32 log decays) and ``beta``
  ``[1, n, Hv]``, ``initial_state`` ``[nb, Hv, d_k, V]`` float32; returns ``(o [1, n, Hv,
  V]`` in q's dtype, ``final [nb, Hv, d_k, V]`` float32). The blocks are one varlen
  batch: ``cu_seqlens`` int64 on the device, its host copy and the chunk indices given,
  so fla reads nothing back from the device. ``d_k <= 256``.
- ``causal_conv1d.causal_conv1d_fn(x, weight, None, seq_idx, None, activation="silu")``:
  ``x`` ``[1, C, L]`` channel-last (stride 1 along C): each block's ``K - 1`` halo rows
  then its rows, ``seq_idx`` ``[1, L]`` int32 the block of each (``initial_states`` would
  serve a batch row's first block only), ``weight`` ``[C, K]``; returns ``[1, C, L]``. A
  channel-last ``x`` needs ``C`` a multiple of 8 (else the torch convolution runs).

**Precision.** A bfloat16 (or float16) model runs fla on its own dtype's q/k/v with a
float32 state, as transformers does. A float32 model runs the torch rule (float32, IEEE
matmuls): fla's Triton path would run its float32 dots as TF32 (``chunk_fwd.py``'s
``SOLVE_TRIL_DOT_PRECISION``), ~1e-3 off where the tests hold float32 to 1e-4.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass, replace
from typing import Callable, Literal

import torch

from graphcp.model.hybrid.gdn import conv_rows, query_key, varlen_gated_delta_rule
from graphcp.model.hybrid.varlen import ChunkSlots, ConvRows, FlaSegments

Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Conv = Callable[[torch.Tensor, ConvRows, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RuleKernel:
    """The chunked gated delta rule over a varlen batch of blocks."""

    name: str
    #: ``fn(q, k, v, g, beta, initial, layout)``: rows ``q``, ``k`` ``[n, Hk, d_k]`` (the
    #: convolution's output), ``v`` ``[n, Hv, V]``, ``g``, ``beta`` ``[n, Hv]`` float32, block
    #: ``b`` from ``initial[b]`` (float32); returns ``(out [n, Hv, V], final [nb, Hv, d_k, V])``
    fn: Rule
    #: the varlen layout ``fn`` reads: ``slots`` (:class:`ChunkSlots`) or ``segments`` (:class:`FlaSegments`)
    layout: Literal["slots", "segments"]
    #: its outputs are float32 (the torch rule): a block's ``p S_in + o0`` is taken from the
    #: augmented pass; else (fla: q's dtype) the outputs come from a second pass from the
    #: composed incoming states (graphcp.model.hybrid.scan)
    float32_outputs: bool


@dataclass(frozen=True)
class ConvKernel:
    """The depthwise causal convolution and its SiLU of every live row."""

    name: str
    #: ``fn(source [*, C], rows: ConvRows, weight [C, K])`` -> ``[n, C]``
    fn: Conv
    #: whether ``fn`` reads ``ConvRows.seq`` (as int32)
    reads_seq: bool


@dataclass(frozen=True)
class LinearKernels:
    """The two kernels of a linear layer's local pass, and why a library was left out."""

    rule: RuleKernel
    conv: ConvKernel
    notes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The libraries that run (``ForwardInfo.stats["linear_kernels"]``): ``torch`` for none."""
        return "+".join(k.name for k in (self.rule, self.conv) if k.name != "torch") or "torch"

    def for_dtype(self, dtype: torch.dtype) -> "LinearKernels":
        """What a model of ``dtype`` runs: a float32 model the torch rule (module doc)."""
        return replace(self, rule=TORCH_RULE) if dtype == torch.float32 else self


def torch_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial: torch.Tensor, slots: ChunkSlots) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference in float32: q/k normalised and scaled (transformers' form), then
    graphcp.model.hybrid.gdn's varlen rule."""
    q, k = query_key(q, k, v.shape[1] // k.shape[1])
    return varlen_gated_delta_rule(q, k, v.float(), g, beta, initial, slots)


TORCH_RULE = RuleKernel("torch", torch_rule, "slots", True)
TORCH_CONV = ConvKernel("torch", conv_rows, False)
TORCH = LinearKernels(TORCH_RULE, TORCH_CONV)


def fla_rule() -> RuleKernel:
    """fla-core's chunked rule on the varlen rows (the call in the module doc)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla

    def rule(q, k, v, g, beta, initial, seg: FlaSegments):
        o, final = fla(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0),
                       beta.to(v.dtype).unsqueeze(0), scale=q.shape[-1] ** -0.5, initial_state=initial,
                       output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=seg.cu_seqlens,
                       cu_seqlens_cpu=seg.cu_seqlens_cpu, chunk_indices=seg.chunk_indices)
        return o[0], final

    return RuleKernel("fla", rule, "segments", False)


def causal_conv1d_conv() -> ConvKernel:
    """causal-conv1d's kernel over the blocks' extended rows (the call in the module doc)."""
    from causal_conv1d import causal_conv1d_fn

    def conv(source, rows: ConvRows, weight):
        if source.shape[1] % 8:  # the kernel refuses a channel-last x of such a width (causal_conv1d.cpp)
            return conv_rows(source, rows, weight)
        ext = source.index_select(0, rows.ext)  # [L, C]: .t() is channel-last
        out = causal_conv1d_fn(ext.t().unsqueeze(0), weight.contiguous(), None, rows.seq.view(1, -1), None,
                               activation="silu")
        return out[0].t().index_select(0, rows.keep)

    return ConvKernel("causal-conv1d", conv, True)


#: the optional libraries: (name, import name, what builds its kernel, what runs without it)
LIBRARIES = (("fla-core", "fla", fla_rule, "the gated delta rule"),
             ("causal-conv1d", "causal_conv1d", causal_conv1d_conv, "the convolution"))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def load(name: str) -> tuple[RuleKernel | ConvKernel | None, str | None]:
    """Library ``name``'s kernel (None where it is not installed or does not import) and,
    for one installed but broken, the note said once on stderr."""
    _, module, build, part = next(lib for lib in LIBRARIES if lib[0] == name)
    if not _installed(module):
        return None, None
    try:
        return build(), None
    except Exception as e:  # noqa: BLE001 - any import failure (ImportError, OSError, a torch ABI RuntimeError)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        why = f"{type(e).__name__}: {first}" if first else type(e).__name__
        note = f"graphcp: note: {name} is installed but does not import ({why}); {part} runs the torch reference"
        print(note, file=sys.stderr, flush=True)
        return None, note


def choose_kernels() -> LinearKernels:
    """The CUDA choice: each library's kernel where it imports, else the torch reference's."""
    (rule, rule_note), (conv, conv_note) = (load(name) for name, *_ in LIBRARIES)
    notes = tuple(n for n in (rule_note, conv_note) if n)
    return LinearKernels(rule or TORCH_RULE, conv or TORCH_CONV, notes)


def select_kernels(device: torch.device) -> LinearKernels:
    """On CUDA :func:`choose_kernels`; the torch reference elsewhere."""
    return choose_kernels() if torch.device(device).type == "cuda" else TORCH
