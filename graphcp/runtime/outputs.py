"""A forward's outputs: this rank's body rows made into every request's logits (and
auxiliary hidden states) in batch order, and one :class:`PrefillOutput` assembled from
them, whichever driver ran the forward (one forward, micro-batches, attention-DP replicas).

The last-token rows are combined across the CP ranks (each request's owner contributes
its row, every other rank zeros: the sum is exactly the owner's), so every rank returns
the same first-token logits; every token's rows are all-gathered and put in batch order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from graphcp.attention.staging import to_device
from graphcp.cp import Plan
from graphcp.dist import CPGroup
from graphcp.model.llama import DecoderModel
from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.batch import DraftOutput, ForwardInfo, PrefillOutput

Rows = torch.Tensor


@dataclass
class OutputHead:
    """The LM head and the gathers over this rank's CP group."""

    model: DecoderModel
    group: CPGroup

    def last_logits(self, plan: Plan, hidden: Rows) -> Rows:
        """Each request's first-token logits, float32 [R, vocab] on the host."""
        mine = np.flatnonzero(plan.last_owner == self.group.rank)
        rows = torch.zeros(plan.num_requests, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        if mine.size:
            where, idx = to_device(np.stack([mine, plan.last_local_index[mine]]), hidden.device)
            rows[where] = hidden.index_select(0, idx)
        # every other rank contributes zeros: the sum is exactly the owner's rows
        self.group.all_reduce_(rows)
        return self.model.logits(rows).cpu()

    def in_batch_order(self, plan: Plan, rows: Rows) -> Rows:
        """Every rank's local rows (padded to the same count), gathered over the CP
        group and put in batch order: [T, ...]."""
        everyone = self.group.all_gather_rows(rows.contiguous())
        return everyone.index_select(0, to_device(plan.gather_index(rows.shape[0]), rows.device))

    def all_logits(self, plan: Plan, hidden: Rows) -> Rows:
        """Every new token's logits, float32 [T, vocab] in batch order."""
        return self.model.logits(self.in_batch_order(plan, hidden)).cpu()

    def aux_gather(self, plan: Plan, rows: Rows | None) -> Rows | None:
        """This stage's auxiliary rows in batch order, float32 [T, n, hidden] (the
        inverse of the CP layout's permutation); None when it holds none."""
        if rows is None:
            return None
        with nvtx_range("aux_hidden", category="output"):
            return self.in_batch_order(plan, rows).float().cpu()

    def outputs(self, plan: Plan, hidden: Rows, aux_rows: Rows | None, all_logits: bool) -> "RequestOutputs":
        """One forward's outputs of its requests (in its plan's order)."""
        ext = plan.extend_lens.tolist()
        with nvtx_range("lm_head", category="output"):
            last = self.last_logits(plan, hidden)
            logits = list(torch.split(self.all_logits(plan, hidden), ext)) if all_logits else None
        aux = self.aux_gather(plan, aux_rows)
        return RequestOutputs(last, logits, None if aux is None else per_request(aux, ext))


def per_request(rows: Rows, extend: list[int]) -> list[Rows]:
    """[T, n, hidden] in batch order -> per request [new_tokens_i, n * hidden]."""
    return [x.reshape(x.shape[0], -1) for x in torch.split(rows, extend)]


@dataclass
class RequestOutputs:
    """Some requests' outputs, in their order: first-token logits [k, vocab], and when asked
    every token's logits and the auxiliary hidden states, a tensor per request."""

    last: Rows
    logits: list[Rows] | None = None
    aux: list[Rows] | None = None


def assemble(num_requests: int, parts: Sequence[tuple[Sequence[int], RequestOutputs]], handles: list,
             info: ForwardInfo, draft: DraftOutput | None = None) -> PrefillOutput:
    """The one PrefillOutput of a batch of ``num_requests`` from the outputs of its parts
    (``(request indices, their outputs)``: one part a forward's requests, an attention-DP
    replica's, ...), ``handles`` in batch order."""
    if len(parts) == 1 and list(parts[0][0]) == list(range(num_requests)):  # one forward: as it is
        out = parts[0][1]
        return PrefillOutput(out.last, handles, out.logits, info, out.aux, draft)
    last: list = [None] * num_requests
    logits: list | None = None
    aux: list | None = None
    for where, out in parts:
        for k, i in enumerate(where):
            last[i] = out.last[k]
        if out.logits is not None:
            logits = logits or [None] * num_requests
            for k, i in enumerate(where):
                logits[i] = out.logits[k]
        if out.aux is not None:
            aux = aux or [None] * num_requests
            for k, i in enumerate(where):
                aux[i] = out.aux[k]
    return PrefillOutput(torch.stack(last), handles, logits, info, aux, draft)
