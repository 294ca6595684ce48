"""A host-side watchdog on a step's device work.

An eager collective that a dead peer never joins fails under the group's timeout (gloo
raises; NCCL's watchdog aborts the communicator). A collective captured in a CUDA graph
is not queued for NCCL's watchdog (``ProcessGroupNCCL.cpp`` enqueues no work while
capturing), so a replay whose peer died never finishes and a blocking read of its
result (``.cpu()``, an event's ``synchronize``) waits forever. The host therefore never
blocks on a step's result: it polls an event recorded after the step's last copy
(:func:`stream_done`) and gives up after the group's collective timeout with the one-line
:class:`~graphcp.dist.CollectiveError` an eager collective gives.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from graphcp.dist import CPGroup

#: the first pause between polls, and the longest (a decode step on a GPU takes milliseconds)
FIRST_PAUSE_S, LONGEST_PAUSE_S = 1e-5, 1e-3


def _always() -> bool:
    return True


def stream_done(device: torch.device | str) -> Callable[[], bool]:
    """Whether the work queued so far on ``device``'s current stream has run: an event
    recorded now (CUDA), or always (a CPU runs each op as it is called)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return _always
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(dev))
    return event.query


def wait_for(done: Callable[[], bool], group: CPGroup, what: str, timeout_s: float | None = None) -> None:
    """Poll ``done`` until it is true; past ``timeout_s`` (the group's collective timeout)
    raise the group's CollectiveError naming ``what`` (the step: its path and bucket)."""
    if done():
        return
    limit = group.timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + limit
    pause = FIRST_PAUSE_S
    while not done():
        if time.monotonic() >= deadline:
            raise group.failure(what, TimeoutError(
                f"its device work did not finish within {limit:g}s; a collective captured in a graph is not "
                "watched by NCCL, so this watchdog ends the step"))
        time.sleep(pause)
        pause = min(2 * pause, LONGEST_PAUSE_S)
