"""One pipeline stage's schedule for a batch of micro-batches (forward only).

Every stage runs micro-batches 0, 1, ..., M - 1 in order. A later stage posts the
receives of all its inputs up front; each stage hands a micro-batch's output rows
on with an asynchronous send, so it starts the next micro-batch at once: while
stage s runs micro-batch k, stage s + 1 runs micro-batch k - 1, and a P-stage
pipeline of M equal micro-batches takes (M + P - 1) / (M P) of the unpipelined
time. The rows a rank hands on are its CP-local rows (no gather): rank (s, r)
sends to (s + 1, r), which owns the same rows of the same plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from graphcp.dist import PeerLink, PendingTransfer
from graphcp.nvtx_ranges import nvtx_range


@dataclass
class StageTimes:
    """Where a stage's time went in one batch (seconds)."""

    compute_s: float = 0.0  # running the stage's body (and, on the last stage, its outputs)
    wait_s: float = 0.0  # waiting for the previous stage's rows (the pipeline bubble, as seen here)
    drain_s: float = 0.0  # waiting for the last sends to complete
    sent_bytes: int = 0
    per_microbatch: list[float] = field(default_factory=list)


def run_stage(
    rows: list[int],
    forward: Callable[[int, torch.Tensor | None], torch.Tensor],
    make_input: Callable[[int], torch.Tensor],
    prev: PeerLink | None,
    next_: PeerLink | None,
) -> StageTimes:
    """Run micro-batches ``0 .. len(rows) - 1`` through this stage.

    ``rows[k]``: this rank's local rows of micro-batch k; ``make_input(n)``: an empty
    [n, hidden] tensor to receive input rows into; ``forward(k, hidden_in)`` runs the
    stage on micro-batch k (``hidden_in`` None on the first stage) and returns its
    output rows, of which the first ``rows[k]`` go to the next stage.
    """
    times = StageTimes()
    recvs: list[PendingTransfer | None] = []
    if prev is not None:
        recvs = [prev.irecv(make_input(n), tag=k) if n else None for k, n in enumerate(rows)]
    sends: list[PendingTransfer] = []
    for k, n in enumerate(rows):
        hidden_in = None
        if prev is not None:
            t0 = time.perf_counter()
            with nvtx_range(f"pp_recv[{k}]", category="comm"):
                hidden_in = recvs[k].wait() if recvs[k] is not None else make_input(0)
            times.wait_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = forward(k, hidden_in)
        if next_ is not None and n:
            # a copy: the body's rows may be a static buffer the next micro-batch overwrites
            rows_out = out[:n].clone()
            sends.append(next_.isend(rows_out, tag=k))
            times.sent_bytes += rows_out.numel() * rows_out.element_size()
        dt = time.perf_counter() - t0
        times.compute_s += dt
        times.per_microbatch.append(dt)
    t0 = time.perf_counter()
    with nvtx_range("pp_send_drain", category="comm"):
        for s in sends:
            s.wait()
    times.drain_s = time.perf_counter() - t0
    return times
