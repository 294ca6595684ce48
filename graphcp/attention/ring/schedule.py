"""The schedule both rings share (pass-KV and pass-Q differ in what travels and what a
step attends, not in when).

Step 0 works on the rank's own data while step 1's transfers are in flight. Before
step ``i`` (1 .. C-1) the rank waits for rank ``(r - i) mod C``'s message, which then
sits in ``stage[i % 2]``, and posts step ``i + 1``'s transfers (forward that message
to ``r + 1``, receive the next from ``r - 1`` into the other buffer, whose previous
content was forwarded in the step before) before running step ``i``: every transfer
overlaps a step's attention. Sizes are every rank's message length in leading rows
of the stage buffers (all ranks know all of them from the plan; a 0 skips that
transfer on both sides).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def run_ring_schedule(group, sizes: Sequence[int], row_bytes: int, first: torch.Tensor,
                      stage: Sequence[torch.Tensor], step: Callable[[int, int], None]) -> int:
    """Run ``step(i, src)`` for i = 0 .. C-1 (``src = (r - i) mod C``; step i >= 1 reads
    ``stage[i % 2][:sizes[src]]``), moving messages around the ring: ``first[:sizes[r]]``
    is this rank's own. Returns the bytes this rank received (``row_bytes`` a row)."""
    C, r = group.size, group.rank
    nxt, prv = (r + 1) % C, (r - 1) % C

    def post(i: int):
        held, incoming = sizes[(r - i + 1) % C], sizes[(r - i) % C]
        source = first if i == 1 else stage[(i - 1) % 2]
        send = source[:held] if held else None
        recv = stage[i % 2][:incoming] if incoming else None
        return group.send_recv(send, nxt, recv, prv)

    pending = post(1)
    step(0, r)
    received = 0
    for i in range(1, C):
        pending.wait()
        src = (r - i) % C
        received += sizes[src] * row_bytes
        if i + 1 < C:
            pending = post(i + 1)
        step(i, src)
    return received
