"""How a hybrid's forward stores and attends: its full-attention layers through the
cache mode's own exchange (the all-gather, or the ring of a token-sharded cache), and
its linear layers through the scan (graphcp.model.hybrid.scan), planned with the batch.

:class:`HybridExchange` wraps the mode's exchange (registered as ``hybrid+<name>``, the
``exchange`` a hybrid cache's storage names): its planner adds this rank's
:class:`~graphcp.model.hybrid.scan.LinearPlan` to the inner plan, and before the body
runs it uploads it (:class:`~graphcp.model.hybrid.scan.LinearScan`) for the linear
layers' breaks to read (:func:`linear_scan`). Every other call goes to the inner
exchange with the inner plan.

Its decode phase (:class:`HybridDecode`) is the inner exchange's (the full layers store and
attend as a dense model's decode step does, or as the family's own attention does: a KDA
hybrid's MLA); a linear layer takes its one-token step (graphcp.model.hybrid.step,
:func:`linear_step`) over the step's state slots, with the step kernels the exchange
gives its decode phase (a Gated DeltaNet step's, or a family's own: KDA's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Sequence

import numpy as np
import torch

from graphcp.attention.kv_exchange import EXCHANGES, KVExchange, KVForward, register_exchange
from graphcp.attention.phase import DECODE, ExchangePhase
from graphcp.cp import Plan
from graphcp.model.hybrid import kernels, step_kernels
from graphcp.model.hybrid.scan import STAT_LINEAR_SENT, LinearPlan, LinearScan
from graphcp.model.hybrid.step import LinearStep
from graphcp.model.hybrid.step_kernels import StepKernels


@dataclass
class HybridPlan:
    """A forward's plan: the inner exchange's, the linear layers', and (once the forward
    is prepared) the inner exchange's view of the forward and the uploaded scan."""

    inner: Any
    linear: LinearPlan
    inner_fwd: KVForward | None = None
    scan: LinearScan | None = None


class HybridPlanner:
    """The inner exchange's planner, and this rank's linear plan of the batch."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def rank_inputs(self, plan: Plan, kv, seq_ids: list[int], rank: int, flat: np.ndarray, device: torch.device,
                    seq_rows: np.ndarray | None = None):
        if seq_rows is None:
            seq_rows = kv.table_rows(seq_ids)
        ins = self.inner.rank_inputs(plan, kv, seq_ids, rank, flat, device, seq_rows)
        states = kv.storage.states  # the hybrid's (graphcp.model.hybrid.cache.LinearStates)
        read, write = states.slots_of(seq_rows, plan.prefix_lens > 0)
        linear = LinearPlan.build(plan, rank, read, write, states.dims.conv_kernel)
        return replace(ins, plan=HybridPlan(ins.plan, linear))


class HybridExchange(KVExchange):
    #: the exchange of the cache mode the full-attention layers use
    inner_name: ClassVar[str] = ""

    def __init__(self, inner: KVExchange, device: torch.device) -> None:
        self.inner, self.device = inner, device
        self.planner = HybridPlanner(inner.planner)
        #: the linear layers' local kernels on this device (fla-core and causal-conv1d on CUDA)
        self.kernels = kernels.select_kernels(device)
        #: the decode phase: the inner exchange's, and the linear layers' step kernels
        self.decode = HybridDecode(inner.decode, step_kernels.select_step_kernels(device))

    @classmethod
    def build(cls, make_backend, group, device: torch.device, planner) -> "HybridExchange":
        return cls(EXCHANGES[cls.inner_name].build(make_backend, group, device, planner), device)

    @staticmethod
    def _inner(fwd: KVForward) -> KVForward:
        return fwd.plan.inner_fwd

    def prepare(self, fwd: KVForward) -> None:
        plan: HybridPlan = fwd.plan
        plan.inner_fwd = replace(fwd, plan=plan.inner)
        plan.scan = LinearScan(plan.linear, fwd.cache.storage.states, fwd.group, self.device, self.kernels)
        self.inner.prepare(plan.inner_fwd)

    def begin(self, fwd: KVForward) -> None:
        self.inner.begin(self._inner(fwd))

    def inert_plan(self, group) -> HybridPlan:
        return HybridPlan(self.inner.inert_plan(group), LinearPlan.inert(group.size))

    def reserve(self, capacity: int, cache, layer: int, heads: int, dim: int, dtype: torch.dtype) -> None:
        full = cache.storage.full_layers
        if full:  # the inner exchange sizes by a layer with K/V
            self.inner.reserve(capacity, cache, full[0], heads, dim, dtype)

    def store(self, fwd: KVForward, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        return self.inner.store(self._inner(fwd), layer, k, v)

    def attend(self, fwd: KVForward, layer: int, q: torch.Tensor, out: torch.Tensor) -> int:
        return self.inner.attend(self._inner(fwd), layer, q, out)

    def describe(self, plan: HybridPlan) -> dict[str, Any]:
        out = self.inner.describe(plan.inner)
        if plan.scan is not None:
            out[STAT_LINEAR_SENT] = plan.scan.stats[STAT_LINEAR_SENT]
        out["linear_kernels"] = (plan.scan.kernels if plan.scan is not None else self.kernels).name
        return out

    def setting(self) -> str:
        return self.inner.setting()


class HybridDecode(ExchangePhase):
    """A hybrid's decode phase: the inner exchange's decode phase for the full layers (its
    plan is the step's merge), and the step kernels the linear layers run (:func:`linear_step`)."""

    phase = DECODE

    def __init__(self, inner: ExchangePhase, kernels: StepKernels) -> None:
        self.inner, self.kernels = inner, kernels
        self.name = inner.name

    def plan(self, *args, **kwargs) -> Any:
        return self.inner.plan(*args, **kwargs)

    def prepare(self, fwd: KVForward) -> None:
        self.inner.prepare(fwd)

    def begin(self, fwd: KVForward) -> None:
        self.inner.begin(fwd)

    def store(self, fwd: KVForward, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        return self.inner.store(fwd, layer, k, v)

    def attend(self, fwd: KVForward, layer: int, q: torch.Tensor, out: torch.Tensor) -> int:
        return self.inner.attend(fwd, layer, q, out)

    def store_rows(self, fwd: KVForward, layer: int, rows: torch.Tensor) -> int:
        return self.inner.store_rows(fwd, layer, rows)

    def attend_own(self, fwd: KVForward, layer: int, run: Callable[[], None], outs: Sequence[torch.Tensor]) -> int:
        return self.inner.attend_own(fwd, layer, run, outs)

    def describe(self, plan: Any) -> dict[str, Any]:
        return {**self.inner.describe(plan), "linear_kernels": self.kernels.name}


@register_exchange
class HybridAllGather(HybridExchange):
    name = "hybrid+all-gather"
    inner_name = "all-gather"


@register_exchange
class HybridRing(HybridExchange):
    name = "hybrid+ring"
    inner_name = "ring"


def linear_scan(fwd: KVForward) -> LinearScan:
    """The forward's linear-layer work (what a linear layer's break calls)."""
    return fwd.plan.scan


def linear_step(fwd: KVForward) -> LinearStep:
    """A decode step's linear-layer work (what a linear layer calls in the decode phase)."""
    return LinearStep(fwd.cache.storage.states, fwd.state_slots, fwd.group, fwd.exchange.decode.kernels)
