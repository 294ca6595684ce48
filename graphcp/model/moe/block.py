"""The sparse MoE block of a decoder layer, in either layout over the CP group.

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

from graphcp.model.layers import ParallelMLP
from graphcp.model.moe.ep import ep_forward, tp_layer_bytes
from graphcp.model.moe.experts import Experts, routed_experts
from graphcp.model.moe.router import make_router
from graphcp.model.moe_config import MoeConfig
from graphcp.options import MoeLayout


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoeConfig, hidden: int, layout: MoeLayout, rank: int, group_size: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.layout, self.num_experts = layout, moe.num_experts
        self.router = make_router(moe, hidden, dtype)
        if layout == "ep":
            local = moe.num_experts // group_size
            self.experts = Experts(local, hidden, moe.intermediate_size, rank * local, dtype)
        else:
            self.experts = Experts(moe.num_experts, hidden, moe.intermediate_size // group_size, 0, dtype)
        self.shared = (ParallelMLP(hidden, moe.shared_intermediate_size, group_size, False, dtype)
                       if moe.shared_intermediate_size else None)

    def forward(self, x: torch.Tensor, group) -> torch.Tensor:
        """The ``tp`` layout: this rank's rows ``[n, hidden]`` -> ``[n, hidden]``."""
        rows = group.all_gather_rows(x)
        ids, weights = self.router(rows)
        out = group.reduce_scatter_rows(routed_experts(rows, ids, weights, self.experts))
        return out if self.shared is None else out + self.shared(x, group)

    def forward_ep(self, x: torch.Tensor, live: int, group, stats: dict | None = None) -> torch.Tensor:
        """The ``ep`` layout: rows ``[n, hidden]`` of which the first ``live`` are real
        (the rest, a bucket's padding, are not routed and get no routed output)."""
        routed = ep_forward(x[:live], self.router, self.experts, group, self.num_experts, stats)
        out = torch.zeros_like(x) if self.shared is None else self.shared(x, group)
        out[:live] += routed
        return out

    def static_bytes(self, rows: int, row_bytes: int, group_size: int) -> int:
        """Bytes each way this block's collectives move at a fixed shape (``rows``
        local rows): the ``tp`` layout's and the shared expert's; the ``ep`` exchange
        depends on the routing and is counted as it runs."""
        n = tp_layer_bytes(rows, row_bytes, group_size) if self.layout == "tp" else 0
        return n + (tp_layer_bytes(rows, row_bytes, group_size) if self.shared is not None else 0)
