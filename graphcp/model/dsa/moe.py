"""DeepSeek's MoE layer (DeepSeek V3.2, GLM-5), tensor-parallel over the CP group.

Router (as transformers' ``DeepseekV32TopkRouter``, float32): sigmoid scores of the
router logits; the expert choice adds ``e_score_correction_bias`` (for selection
only), keeps the ``topk_group`` best of ``n_group`` expert groups (a group scores by
its best two experts) and takes the top ``num_experts_per_tok`` experts there; the
weights are the chosen experts' unbiased scores, renormalised when
``norm_topk_prob``, times ``routed_scaling_factor``.

Layout ``tp`` (every rank holds every expert's ``I / C`` slice, like the dense MLP):
rows all-gathered, the router on all of them (the same choice on every rank), the
experts as one grouped matmul over the (token, expert) pairs sorted by expert, the
weighted sum in ascending expert order (transformers' order), the shared experts'
partial sum added, one reduce-scatter back to local rows. Static shapes: inside the
captured graphs.

The seam to the MoE machinery of issue 17 (``graphcp/model/moe/``, ``--moe ep|tp``; DSA
models refuse ``ep`` until they run on it):
:class:`DeepseekRouter` keeps its ``Router`` contract (``forward(x) -> (ids, weights)``,
ids ascending in each row), so it plugs into its ``SparseMoeBlock`` as the router for
sigmoid scoring; the expert-parallel layout (all-to-all dispatch and combine) then
comes from there, and :class:`TpExperts` is that block's ``tp`` layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphcp.dsa_config import DeepseekMoeConfig
from graphcp.errors import ConfigError
from graphcp.model.layers import ParallelMLP


class DeepseekRouter(nn.Module):
    def __init__(self, m: DeepseekMoeConfig, hidden: int) -> None:
        super().__init__()
        self.m = m
        # float32 whatever the model's dtype (transformers keeps both in float32)
        self.weight = nn.Parameter(torch.empty(m.num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(m.num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [n, hidden]`` -> expert ids ``[n, top_k]`` (int64, ascending) and their
        float32 weights."""
        m, n = self.m, x.shape[0]
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = m.num_experts // m.n_group
        group_scores = choice.view(n, m.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=m.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        keep = keep.unsqueeze(-1).expand(n, m.n_group, per_group).reshape(n, m.num_experts)
        ids = torch.topk(choice.masked_fill(~keep, float("-inf")), k=m.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * m.routed_scaling_factor
        ids, perm = torch.sort(ids, dim=-1)
        return ids, torch.gather(weights, -1, perm)


class TpExperts(nn.Module):
    """Every routed expert's ``I / C`` slice: SwiGLU weights stacked expert-major, as
    2-D parameters (one checkpoint tensor is one slice of one of them): ``gate_up``
    ``[E * 2 I_c, hidden]`` (expert e: its gate rows, then its up rows), ``down``
    ``[E * hidden, I_c]``."""

    def __init__(self, num_experts: int, hidden: int, shard: int, dtype: torch.dtype) -> None:
        super().__init__()
        for what, row_bytes in (("moe_intermediate_size / cp_size", shard), ("hidden_size", hidden)):
            if row_bytes * dtype.itemsize % 16:
                raise ConfigError(f"{what} = {row_bytes} {dtype} values is not a multiple of 16 bytes: the grouped "
                                  "expert matmul needs 16-byte aligned rows")
        self.num_experts, self.hidden, self.shard = num_experts, hidden, shard
        self.gate_up = nn.Parameter(torch.empty(num_experts * 2 * shard, hidden, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts * hidden, shard, dtype=dtype), requires_grad=False)

    def forward(self, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum over its slice of the weighted expert outputs of each
        row (``ids``/``weights`` ``[n, k]``, ids ascending) -> ``[n, hidden]``."""
        n, k = ids.shape
        e, h, s = self.num_experts, self.hidden, self.shard
        sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
        ends = torch.searchsorted(sorted_ids, torch.arange(e, device=ids.device), right=True).to(torch.int32)
        x = rows.index_select(0, torch.div(order, k, rounding_mode="floor"))
        gu = torch._grouped_mm(x, self.gate_up.view(e, 2 * s, h).transpose(1, 2), offs=ends)
        y = torch._grouped_mm(F.silu(gu[:, :s]) * gu[:, s:], self.down.view(e, h, s).transpose(1, 2), offs=ends)
        y = torch.empty_like(y).index_copy_(0, order, y).view(n, k, h)  # back to (token, slot) order
        # each product in float32, cast, summed in slot (ascending expert) order, as transformers adds them
        acc = (y[:, 0] * weights[:, :1]).to(rows.dtype)
        for j in range(1, k):
            acc = acc + (y[:, j] * weights[:, j : j + 1]).to(rows.dtype)
        return acc


class DeepseekMoe(nn.Module):
    def __init__(self, m: DeepseekMoeConfig, hidden: int, tp_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = DeepseekRouter(m, hidden)
        self.experts = TpExperts(m.num_experts, hidden, m.intermediate_size // tp_size, dtype)
        self.shared_experts = (ParallelMLP(hidden, m.shared_intermediate_size, tp_size, False, dtype)
                               if m.num_shared else None)

    def forward(self, x: torch.Tensor, group) -> torch.Tensor:
        """This rank's rows ``[n, hidden]`` -> ``[n, hidden]``."""
        rows = group.all_gather_rows(x)
        partial = self.experts(rows, *self.gate(rows))
        if self.shared_experts is not None:  # added before the one reduce-scatter
            partial = partial + self.shared_experts.partial(rows)
        return group.reduce_scatter_rows(partial)
