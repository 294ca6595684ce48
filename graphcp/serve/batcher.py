"""What one batch of the worker holds, and what one request may hold.

A batch is the oldest queued requests, as many as fit: at most ``max_requests``, their
tokens within the KV pool, and their largest rank's local rows (the CP layout's plan of
the batch) within the largest bucket, so that a batch replays a captured graph. A
request alone must fit the same bounds and the model's context: one that does not is
refused when it arrives (:class:`graphcp.serve.protocol.Limits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from graphcp.cp import Layout
from graphcp.runtime.engine import PrefillEngine
from graphcp.serve.protocol import Limits


@dataclass(frozen=True)
class Batcher:
    layout: Layout
    #: the largest bucket's local rows: a batch's largest rank holds at most this many
    row_limit: int
    max_requests: int
    #: the KV pool's tokens (a batch's pages, rounded, at most this)
    pool_tokens: int
    page_size: int

    @classmethod
    def of(cls, engine: PrefillEngine) -> "Batcher":
        p = engine.parts
        return cls(p.layout, p.buckets.largest, engine.runtime.max_requests, p.kv.capacity_tokens, p.kv.page_size)

    def rows(self, lengths: Sequence[int]) -> int:
        """The largest rank's local rows of a batch of requests of ``lengths`` new tokens."""
        return self.layout.plan(list(lengths)).max_local_rows

    def fit(self, lengths: Sequence[int]) -> int:
        """How many of ``lengths`` (the queue's requests, oldest first) the next batch takes:
        the longest run from the first that fits (at least the first, admitted alone)."""
        n, pages = 0, 0
        for k, length in enumerate(lengths[: self.max_requests]):
            pages += -(-length // self.page_size)
            if pages * self.page_size > self.pool_tokens or self.rows(lengths[: k + 1]) > self.row_limit:
                break
            n = k + 1
        return max(n, 1)

    def limits(self, vocab_size: int, max_context: int) -> Limits:
        """What one request may hold (the smallest of the three bounds, named)."""
        lo, hi = 1, max_context  # the most tokens one request's rows fit the largest bucket
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.rows([mid]) <= self.row_limit else (lo, mid - 1)
        bounds = [(lo, f"the largest bucket holds {self.row_limit} local rows at CP {self.layout.cp_size}"),
                  (max_context, "the model's context"), (self.pool_tokens, "the KV pool")]
        most, why = min(bounds, key=lambda b: b[0])
        return Limits(vocab_size, most, why)
