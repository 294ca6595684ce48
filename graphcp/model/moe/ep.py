"""Expert parallelism over the CP group: the all-to-all dispatch and combine, beside
the host plan that sizes them.

Rank r holds experts ``[r * E/C, (r + 1) * E/C)``. One forward of a layer, on the
rank's live rows only (padding rows of a bucket are never routed):

1. route the rows; sort the (token, expert) pairs by expert (so by owning rank);
2. all-gather every rank's per-expert pair counts (``C x E`` int64, one small
   collective): every rank then knows every split, and the host builds the plan;
3. dispatch: one ``all_to_all_single`` sends each pair's row to its expert's rank
   (uneven splits, zeros included); the received rows (source-major) are permuted
   expert-major and run through the local experts (grouped, one matmul each);
4. combine: the outputs are permuted back and one ``all_to_all_single`` returns them
   to the token's rank, in the order they were sent; the weighted sum over the k
   slots is formed there in slot order (:func:`combine`), so the result does not
   depend on which rank computed which expert.

The split sizes are host integers read from the counts, so this runs eagerly: a
graph break at replay (``graphcp/model/llama.py``).

Bytes, per rank: what its collectives move to or from other ranks (rows a rank sends
itself are not counted): the rows it dispatches and receives back, the rows it receives
and returns, and the counts all-gather. For the ``tp`` layout (:func:`tp_layer_bytes`),
the all-gather and reduce-scatter of bandwidth-optimal (ring) algorithms: each rank
sends and receives ``(C - 1) * n`` rows in each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphcp.attention.staging import to_device
from graphcp.model.communicator import ffn_bytes
from graphcp.model.moe.experts import Experts, combine, sort_by_expert, unsort
from graphcp.nvtx_ranges import nvtx_range

#: the per-forward figures the MoE layers add to ForwardInfo.stats (docs/moe.md)
STAT_LAYOUT = "moe_layout"
STAT_LAYERS = "moe_layers"
STAT_SENT = "moe_bytes_sent"
STAT_RECEIVED = "moe_bytes_received"
STAT_IMBALANCE = "moe_routing_imbalance"
COUNT_BYTES = 8  # the per-expert counts are int64


@dataclass(frozen=True)
class ExchangePlan:
    """One layer's dispatch and combine on one rank, from every rank's per-expert pair
    counts. Pure host code (numpy)."""

    send_rows: list[int]  # pairs this rank dispatches to each rank
    recv_rows: list[int]  # pairs each rank dispatches to this one
    #: expert-major position -> row of the (source-major) received block
    expert_major: np.ndarray
    local_ends: np.ndarray  # int32 [E_local]: cumulative pairs per local expert
    per_rank: np.ndarray  # [C] pairs routed to each rank's experts (the whole group's)

    @classmethod
    def build(cls, counts: np.ndarray, rank: int, experts_per_rank: int) -> "ExchangePlan":
        """``counts[s, e]``: pairs rank s routes to expert e (``C x E``)."""
        C, El = counts.shape[0], experts_per_rank
        by_rank = counts.reshape(C, C, El)  # [source, destination rank, local expert]
        mine = by_rank[:, rank, :]  # [source, local expert]: what this rank receives
        src_start = (np.cumsum(mine.reshape(-1)) - mine.reshape(-1)).reshape(C, El)
        lens = mine.T.reshape(-1)  # blocks in expert-major order: (expert, source)
        em_start = np.cumsum(lens) - lens
        total = int(lens.sum())
        perm = np.repeat(src_start.T.reshape(-1) - em_start, lens) + np.arange(total)
        return cls(
            send_rows=by_rank[rank].sum(axis=1).tolist(),
            recv_rows=mine.sum(axis=1).tolist(),
            expert_major=perm.astype(np.int64),
            local_ends=np.cumsum(mine.sum(axis=0)).astype(np.int32),
            per_rank=by_rank.sum(axis=(0, 2)),
        )

    def bytes_each_way(self, rank: int, row_bytes: int, num_experts: int) -> int:
        """Bytes this rank sends to (and, the same, receives from) other ranks: the
        dispatch and combine rows and the counts all-gather."""
        C = len(self.send_rows)
        rows = sum(self.send_rows) - self.send_rows[rank] + sum(self.recv_rows) - self.recv_rows[rank]
        return rows * row_bytes + (C - 1) * num_experts * COUNT_BYTES

    @property
    def imbalance(self) -> float:
        """max / mean pairs per expert rank (1.0: balanced, or nothing routed)."""
        mean = float(self.per_rank.mean())
        return float(self.per_rank.max()) / mean if mean > 0 else 1.0


def ep_forward(x: torch.Tensor, router, experts: Experts, group, num_experts: int,
               stats: dict | None = None) -> torch.Tensor:
    """The routed experts of this rank's live rows ``x [n, hidden]`` with the experts
    split over ``group`` (see the module doc) -> ``[n, hidden]`` in ``x``'s dtype."""
    ids, weights = router(x)
    k = ids.shape[1]
    order, ends = sort_by_expert(ids, num_experts)
    counts = torch.diff(ends.to(torch.int64), prepend=ends.new_zeros(1, dtype=torch.int64))
    counts = group.all_gather_rows(counts.view(1, num_experts)).cpu().numpy()
    plan = ExchangePlan.build(counts, group.rank, experts.num_local)
    dev = x.device
    with nvtx_range("moe_dispatch", category="comm"):
        sent = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
        received = group.all_to_all_rows(sent, plan.send_rows, plan.recv_rows)
    perm, local_ends = to_device(plan.expert_major, dev), to_device(plan.local_ends, dev)
    out = experts(received.index_select(0, perm), local_ends)
    with nvtx_range("moe_combine", category="comm"):
        back = group.all_to_all_rows(unsort(out, perm), plan.recv_rows, plan.send_rows)
    if stats is not None:
        b = plan.bytes_each_way(group.rank, x.shape[1] * x.element_size(), num_experts)
        stats[STAT_SENT] = stats.get(STAT_SENT, 0) + b
        stats[STAT_RECEIVED] = stats.get(STAT_RECEIVED, 0) + b
        stats[STAT_IMBALANCE] = max(stats.get(STAT_IMBALANCE, 1.0), plan.imbalance)
    return combine(unsort(back, order), weights, x.dtype)


def tp_layer_bytes(rows: int, row_bytes: int, cp_size: int, attn_tp_size: int = 1) -> int:
    """Bytes a rank sends (and receives) in one ``tp`` MoE layer over ``rows`` local
    rows: the all-gather before and the reduce-scatter after (ring algorithms), and the
    all-reduce over attention TP (the layer communicator's figure)."""
    return ffn_bytes(rows, row_bytes, cp_size, attn_tp_size)
