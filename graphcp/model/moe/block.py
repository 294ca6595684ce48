"""The sparse MoE block of a decoder layer, in either layout over the stage's T ranks
(the CP group when attention TP is 1; the layer communicator moves the rows).

- ``tp``: every rank holds every expert's ``I / C`` slice (gate/up rows, down
  columns), like the dense MLP: rows all-gathered before, the router run on all of
  them (the same result on every rank), the grouped experts, the weighted partial
  sums reduce-scattered back to local rows. Static shapes: inside the captured graphs.
- ``ep``: rank r holds experts ``[r E/C, (r + 1) E/C)`` whole; routing on the rank's
  own live rows and the all-to-all exchange (``ep.py``). Host-sized: run eagerly, in
  the layer's graph break.

An optional shared expert (a dense MLP added to the routed output, as DeepSeek's) is
TP-sharded like the dense MLP and runs on the rank's full (padded) rows in both.
"""

from __future__ import annotations

import torch
from torch import nn

from graphcp.model.communicator import LayerCommunicator, attention_reduce_bytes
from graphcp.model.layers import ParallelMLP
from graphcp.model.moe.ep import STAT_RECEIVED, STAT_SENT, ep_forward, tp_layer_bytes
from graphcp.model.moe.experts import Experts, routed_experts
from graphcp.model.moe.router import make_router
from graphcp.model.moe_config import MoeConfig
from graphcp.options import MoeLayout


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoeConfig, hidden: int, layout: MoeLayout, rank: int, group_size: int,
                 dtype: torch.dtype, limit: float | None = None) -> None:
        """``limit``: a SwiGLU clamp of the experts and the shared expert (GLM-5-Next's
        ``swiglu_limit``; None: none)."""
        super().__init__()
        self.layout, self.num_experts = layout, moe.num_experts
        self.router = make_router(moe, hidden, dtype)
        if layout == "ep":
            local = moe.num_experts // group_size
            self.experts = Experts(local, hidden, moe.intermediate_size, rank * local, dtype, limit)
        else:
            self.experts = Experts(moe.num_experts, hidden, moe.intermediate_size // group_size, 0, dtype, limit)
        self.shared = (ParallelMLP(hidden, moe.shared_intermediate_size, group_size, False, dtype, limit)
                       if moe.shared_intermediate_size else None)

    def forward(self, x: torch.Tensor, group) -> torch.Tensor:
        """The ``tp`` layout: this rank's rows ``[n, hidden]`` -> ``[n, hidden]``;
        ``group``: the layer communicator, or a CP group (CP = TP)."""
        comm = LayerCommunicator.of(group)
        rows = comm.enter_ffn(x)
        ids, weights = self.router(rows)
        out = comm.leave_ffn(routed_experts(rows, ids, weights, self.experts))
        return out if self.shared is None else out + self.shared(x, comm)

    def forward_ep(self, x: torch.Tensor, live: int, group, stats: dict | None = None) -> torch.Tensor:
        """The ``ep`` layout: rows ``[n, hidden]`` of which the first ``live`` are real
        (the rest, a bucket's padding, are not routed and get no routed output). Under
        attention TP each rank of a partition dispatches its slice of the live rows over
        the stage's ranks (the communicator's ep_slice) and the slices are gathered back."""
        comm = LayerCommunicator.of(group)
        start, stop = comm.ep_slice(live)
        routed = comm.ep_gather(
            ep_forward(x[start:stop], self.router, self.experts, comm.ffn, self.num_experts, stats), live)
        if stats is not None and comm.attn_tp.size > 1:  # the slices put back together
            b = attention_reduce_bytes(live, x.shape[1] * x.element_size(), comm.attn_tp.size)
            stats[STAT_SENT] = stats.get(STAT_SENT, 0) + b
            stats[STAT_RECEIVED] = stats.get(STAT_RECEIVED, 0) + b
        out = torch.zeros_like(x) if self.shared is None else self.shared(x, comm)
        out[:live] += routed
        return out

    def static_bytes(self, rows: int, row_bytes: int, group_size: int, attn_tp_size: int = 1) -> int:
        """Bytes each way this block's collectives move at a fixed shape (``rows``
        local rows; ``group_size``: the CP degree): the ``tp`` layout's and the shared
        expert's; the ``ep`` exchange depends on the routing and is counted as it runs."""
        one = tp_layer_bytes(rows, row_bytes, group_size, attn_tp_size)
        return (one if self.layout == "tp" else 0) + (one if self.shared is not None else 0)
