"""Splitting a batch into micro-batches.

A batch of T new tokens becomes M micro-batches of about T / M tokens each, cut in
token order (requests in batch order). A cut lands on a request boundary when one
lies within T / (8 M) tokens of the even cut point, so whole requests stay whole
when the batch has several; otherwise it falls inside a request, which then runs as
chunks in consecutive micro-batches: chunk i + 1 extends chunk i's KV, which is
exact because every stage runs micro-batches in order, so chunk i's KV is in a
stage's cache before chunk i + 1 reaches that stage. The micro-batches' new tokens,
concatenated in order, are the batch's in batch order. Pure host code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Piece:
    """New tokens ``start:stop`` of request ``request`` (a whole request or a chunk)."""

    request: int
    start: int
    stop: int

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


def split_microbatches(extend_lens: Sequence[int], m: int) -> list[list[Piece]]:
    """The micro-batches of a batch with these new-token counts: ``min(m, T)`` lists of
    pieces, each non-empty, every token in exactly one piece, each request at most
    once per micro-batch and its pieces in token order."""
    lens = np.asarray(extend_lens, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)])
    total = int(cu[-1])
    m = max(1, min(int(m), total))
    tol = total / (8 * m)
    cuts = [0]
    for k in range(1, m):
        target = round(k * total / m)
        near = int(cu[np.abs(cu - target).argmin()])
        cuts.append(near if abs(near - target) <= tol and cuts[-1] < near < total else target)
    cuts.append(total)
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        first = int(np.searchsorted(cu, a, side="right")) - 1
        pieces = []
        j = first
        while j < len(lens) and cu[j] < b:
            lo, hi = max(a, int(cu[j])), min(b, int(cu[j + 1]))
            if hi > lo:
                pieces.append(Piece(j, lo - int(cu[j]), hi - int(cu[j])))
            j += 1
        out.append(pieces)
    return out


def last_pieces(microbatches: list[list[Piece]], num_requests: int) -> list[tuple[int, int]]:
    """For each request, (micro-batch, index in it) of its last piece: where its
    last-token logits come from."""
    where: list[tuple[int, int]] = [(-1, -1)] * num_requests
    for k, mb in enumerate(microbatches):
        for i, p in enumerate(mb):
            where[p.request] = (k, i)
    return where
