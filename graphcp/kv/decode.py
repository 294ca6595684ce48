"""One decode step's reservation: where each request's new token lands, as the cache mode
decides it (its placement's ``reserve_decode``, graphcp.kv.placement).

A decode step adds one token to each of a batch of live requests, at position
``num_tokens`` of each. A replicated or layer-split cache stores it on every rank (a
layer-split rank writes the layers it does not own to its scratch layer); the
token-sharded cache stores it on one rank (:func:`decode_owner`: the rank holding the
fewest of the request's tokens, round-robin among equals, as vLLM's interleave of decode
tokens goes), and its ledger records it. What a rank then attends over is its own share of each request:
:attr:`DecodeSlots.local_lens` tokens in its pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: ``DecodeSlots.holder`` of a token every rank stores
EVERY_RANK = -1


@dataclass(frozen=True)
class DecodeSlots:
    """What one decode step reserved on this rank, per request in batch order."""

    seq_ids: list[int]
    rows: np.ndarray  # int64 [B]: each request's row of the cache's page table
    positions: np.ndarray  # int64 [B]: the new token's position (its request's tokens before)
    holder: np.ndarray  # int64 [B]: the rank that stores the new token (EVERY_RANK: all of them)
    local_lens: np.ndarray  # int64 [B]: the request's tokens this rank holds after the step
    slots: np.ndarray  # int64 [B]: this rank's cache slot of the new token, -1 where another rank stores it
    #: int64 [2, B]: each request's state slot the step reads and the one it writes (None: a
    #: storage without per-request state)
    states: np.ndarray | None = None
    #: a step of several rows a request (a verify step): the one-token reservations it is
    #: made of, in order (row i of every request is ``steps[i]``); its own fields are per
    #: row, request-major (:func:`stack_steps`)
    steps: tuple["DecodeSlots", ...] = ()

    @property
    def num_requests(self) -> int:
        """Its rows (one a request, or a verify step's ``len(steps)`` a request)."""
        return len(self.seq_ids)

    @property
    def rows_per_request(self) -> int:
        return max(1, len(self.steps))

    def subset(self, sel: np.ndarray) -> "DecodeSlots":
        """The rows ``sel`` (an index or mask array) as a step of their own (one-row-a-request
        fields: a verify step's rows, or one-token reservations of some of its requests)."""
        idx = np.flatnonzero(sel) if sel.dtype == bool else sel
        return DecodeSlots([self.seq_ids[i] for i in idx.tolist()], self.rows[idx], self.positions[idx],
                           self.holder[idx], self.local_lens[idx], self.slots[idx],
                           None if self.states is None else self.states[:, idx])


def stack_steps(steps: list[DecodeSlots]) -> DecodeSlots:
    """One step of ``len(steps)`` rows a request from the one-token reservations made one
    after the other: row ``j * n + i`` is request j's token of ``steps[i]``, whose
    ``local_lens`` (this rank's tokens of the request after it) are the row's causal
    length: a row attends over what the rank holds up to its own position."""
    n, first = len(steps), steps[0]
    B = first.num_requests

    def rows(name: str) -> np.ndarray:
        return np.stack([getattr(s, name) for s in steps], axis=1).reshape(B * n)

    return DecodeSlots([s for s in first.seq_ids for _ in range(n)], rows("rows"), rows("positions"), rows("holder"),
                       rows("local_lens"), rows("slots"), None, tuple(steps))


def state_rows(states: np.ndarray | None, capacity: int, out: np.ndarray) -> np.ndarray:
    """``out`` [2, capacity]: a step's (read, write) state slots (``states`` [2, B], None:
    no live row) padded to ``capacity`` rows. A padding row reads and writes one slot that
    no live row writes (the first request's read slot; slot 0 with no live row): a step
    keeps a row whose two slots are the same as it was, so padding changes nothing."""
    B = 0 if states is None else states.shape[1]
    if B:
        out[:, :B] = states
    out[:, B:] = states[0, 0] if B else 0
    return out


def decode_owner(held: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """int64 [B]: the rank of a token-sharded cache that stores each request's decoded
    token: the rank holding the fewest of the request's tokens (``held`` [B, C] before the
    step), ties going to the first such rank at or after ``position mod C``. So a request's
    decoded tokens go round-robin over its ranks once they hold as many (what vLLM's
    interleave of decode tokens does), and first even out what its prefill chunks left
    uneven: the ranks stay within one token of each other while a request decodes."""
    held = np.asarray(held, dtype=np.int64)
    C = held.shape[1]
    order = (np.arange(C, dtype=np.int64)[None, :] - np.asarray(positions, dtype=np.int64)[:, None]) % C
    fewest = held == held.min(axis=1, keepdims=True)
    return np.where(fewest, order, C).argmin(axis=1).astype(np.int64)


#: one run of decoded positions: ``(first position, count, the request's tokens on each rank
#: before its first step)``; the owners of its positions follow from these (:func:`run_owners`)
DecodedRun = tuple[int, int, tuple[int, ...]]


def add_decoded(runs: tuple[DecodedRun, ...], position: int, held: tuple[int, ...]) -> tuple[DecodedRun, ...]:
    """``runs`` with ``position`` decoded (``held``: the request's tokens on each rank
    before it); it extends the last run when it follows it (a turn's steps are one run)."""
    if runs and runs[-1][0] + runs[-1][1] == position:
        first, count, base = runs[-1]
        return runs[:-1] + ((first, count + 1, base),)
    return runs + ((position, 1, tuple(held)),)


def drop_decoded(runs: tuple[DecodedRun, ...]) -> tuple[DecodedRun, ...]:
    """``runs`` without its last decoded position (the undo of :func:`add_decoded`)."""
    first, count, base = runs[-1]
    return runs[:-1] + (((first, count - 1, base),) if count > 1 else ())


def run_owners(run: DecodedRun) -> np.ndarray:
    """int64 [count]: the rank that stores each position of one run (:func:`decode_owner`,
    step by step from the counts before the run)."""
    first, count, base = run
    held = np.array([base], dtype=np.int64)
    out = np.empty(count, dtype=np.int64)
    for i in range(count):
        out[i] = k = int(decode_owner(held, np.array([first + i]))[0])
        held[0, k] += 1
    return out


def decoded_positions(runs: tuple[DecodedRun, ...], rank: int) -> np.ndarray:
    """int64: the decoded positions of ``runs`` that rank ``rank`` of a token-sharded cache holds."""
    out = [np.arange(first, first + count, dtype=np.int64)[run_owners((first, count, base)) == rank]
           for first, count, base in runs]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
