"""The layer communicator: moves a layer's hidden rows between the attention layout and
the FFN layout (docs/parallel.md). Only it knows which rows a rank holds in which.

- Attention layout: rank (cp c, attn_tp a) holds its CP partition's rows (the layout's
  local rows), the same rows on every attention-TP rank of the partition, with its own
  heads; after o_proj the attention-TP partial sums are all-reduced
  (:meth:`reduce_attention`), so the rows are whole again on each of them.
- FFN layout, dense MLP and MoE ``tp`` (TP over all T = D x C x A ranks of the stage):
  every row of the batch, of every DP replica (:meth:`enter_ffn`: all-gather over CP,
  then over DP), multiplied by the rank's 1 / T shard; :meth:`leave_ffn` reduce-scatters
  the partial sums over DP and CP back to each partition's rows and all-reduces them
  over attention TP.
- FFN layout, MoE ``ep`` (experts split over the T ranks): each attention-TP rank of a
  partition dispatches a disjoint slice of the partition's live rows
  (:meth:`ep_slice`) over the FFN group; :meth:`ep_gather` puts the slices back
  together (an all-reduce over attention TP of rows that are zero outside each slice:
  exact).

With attention TP 1 it is exactly the CP = TP path (attention TP collectives are no-ops).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graphcp.dist import CPGroup


@dataclass
class LayerCommunicator:
    cp: CPGroup
    attn_tp: CPGroup = field(default_factory=CPGroup)
    #: every rank of the stage (the MoE ep exchange); None: the CP group (attention TP 1)
    ffn: CPGroup | None = None
    #: the attention-DP replicas at this rank's (cp, attn_tp) coordinates (size 1: no DP)
    dp: CPGroup = field(default_factory=CPGroup)

    def __post_init__(self) -> None:
        if self.ffn is None:
            self.ffn = self.cp

    @classmethod
    def of(cls, group) -> LayerCommunicator:
        """``group`` itself when it is a communicator, else CP = TP over the CP group ``group``."""
        return group if isinstance(group, LayerCommunicator) else cls(group)

    @property
    def tp_size(self) -> int:
        """The FFN's TP degree: D x C x A."""
        return self.dp.size * self.cp.size * self.attn_tp.size

    def reduce_attention(self, y: torch.Tensor) -> torch.Tensor:
        """o_proj's partial sums over the partition's heads -> the whole rows (in place)."""
        return self.attn_tp.all_reduce_(y)

    def enter_ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The partition's rows [n, h] -> every row of the batch [C * n, h] (CP rank-major);
        under attention DP every replica's batch, [D * C * n, h] (replica-major: every
        replica runs the same capacity n)."""
        return self.dp.all_gather_rows(self.cp.all_gather_rows(x))

    def leave_ffn(self, partial: torch.Tensor) -> torch.Tensor:
        """Every row's partial sum [D * C * n, h] -> the partition's rows of the sum [n, h]."""
        return self.attn_tp.all_reduce_(self.cp.reduce_scatter_rows(self.dp.reduce_scatter_rows(partial)))

    def ep_slice(self, live: int) -> tuple[int, int]:
        """The live rows of the partition this rank dispatches to the experts."""
        A, a = self.attn_tp.size, self.attn_tp.rank
        return live * a // A, live * (a + 1) // A

    def ep_gather(self, routed: torch.Tensor, live: int) -> torch.Tensor:
        """This rank's routed slice (:meth:`ep_slice`) -> the partition's ``live`` rows."""
        if self.attn_tp.size == 1:
            return routed
        start, stop = self.ep_slice(live)
        out = routed.new_zeros((live, routed.shape[1]))
        out[start:stop] = routed
        return self.attn_tp.all_reduce_(out)



@dataclass
class ReplicatedRows(LayerCommunicator):
    """A decode step's layout (docs/decode.md): every rank of a replica holds the same rows
    (each of its requests' one new token). Without attention DP the FFN needs no gather:
    each rank multiplies every row by its weight shard and the partial sums are
    all-reduced over the FFN group (the same sum on every rank); MoE ``ep`` dispatches a
    disjoint slice of the rows from each rank of the FFN group and all-reduces the slices
    back (zero outside each: exact). Under attention DP (every replica's step at the same
    rows, the largest replica's) the FFN takes every replica's rows as in prefill: an
    all-gather over DP in, a reduce-scatter over DP out, then the sum over the replica's
    own ranks (CP, then attention TP); ``ep`` slices over the replica's ranks."""

    def enter_ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.dp.all_gather_rows(x)

    def leave_ffn(self, partial: torch.Tensor) -> torch.Tensor:
        if self.dp.size == 1:
            return self.ffn.all_reduce_(partial)
        return self._replica_sum(self.dp.reduce_scatter_rows(partial))

    def _replica_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of this rank's replica (its CP and attention-TP ranks)."""
        return self.attn_tp.all_reduce_(self.cp.all_reduce_(x))

    def _replica_rank(self) -> tuple[int, int]:
        """(this rank's index, the ranks) among the ranks holding its rows: the FFN group's
        without DP, the replica's under DP."""
        if self.dp.size == 1:
            return self.ffn.rank, self.ffn.size
        return self.cp.rank * self.attn_tp.size + self.attn_tp.rank, self.cp.size * self.attn_tp.size

    def ep_slice(self, live: int) -> tuple[int, int]:
        t, T = self._replica_rank()
        return live * t // T, live * (t + 1) // T

    def ep_gather(self, routed: torch.Tensor, live: int) -> torch.Tensor:
        if self._replica_rank()[1] == 1:
            return routed
        start, stop = self.ep_slice(live)
        out = routed.new_zeros((live, routed.shape[1]))
        out[start:stop] = routed
        return self.ffn.all_reduce_(out) if self.dp.size == 1 else self._replica_sum(out)


def ffn_bytes(rows: int, row_bytes: int, cp_size: int, attn_tp_size: int = 1, dp_size: int = 1) -> int:
    """Bytes each way a rank's :meth:`LayerCommunicator.enter_ffn` + ``leave_ffn`` move for
    ``rows`` partition rows (ring algorithms): the all-gather and the reduce-scatter over
    CP, ``(C - 1) n`` rows each, over DP, ``(D - 1) C n`` each, and the all-reduce over
    attention TP, ``2 (A - 1) n / A``."""
    C, A, D = cp_size, attn_tp_size, dp_size
    return (2 * (C - 1) * rows * row_bytes + 2 * (D - 1) * C * rows * row_bytes
            + 2 * (A - 1) * rows * row_bytes // A)


def attention_reduce_bytes(rows: int, row_bytes: int, attn_tp_size: int) -> int:
    """Bytes each way of :meth:`LayerCommunicator.reduce_attention` (a ring all-reduce)."""
    return 2 * (attn_tp_size - 1) * rows * row_bytes // attn_tp_size
