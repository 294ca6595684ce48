"""Host-to-device uploads from pinned memory, fenced: a pinned-to-device copy reads its
source when it *runs*, not when it is queued, so a host that rewrites the buffer for the
next batch before the queued copy ran sends the next batch's values with this one's
launch. Whoever rewrites a pinned buffer marks an event after its copies (``mark``) and
waits on it before the next rewrite (``wait``).

Two users: the runtime's static input buffers (:class:`~graphcp.runtime.capture.static_buffers.StaticBuffers`
stages token ids, positions and slots in pinned copies), and FlashInfer's ``plan``,
which uploads its tile schedule from a per-wrapper pinned buffer with ``cudaMemcpyAsync``
(``scheduler.cuh``). Only the last pipeline stage synchronises the host each forward
(``.cpu()`` of the logits); an earlier stage's host runs ahead into the next micro-batch.

Tests pass a fake engine with the same four methods that defers every upload until a
wait or a sync (``tests/fake_copy_engine.py``), so the race shows on the CPU.
"""

from __future__ import annotations

import torch


class PinnedStaging:
    """Pinned host buffers, asynchronous uploads and the fence between rewrites (CUDA)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._event = None

    def host(self, n: int, dtype: torch.dtype, fill_value: int | float = 0) -> torch.Tensor:
        """A pinned host buffer of ``n`` values."""
        return torch.full((n,), fill_value, dtype=dtype, pin_memory=True)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst <- src`` (src pinned): it reads ``src`` when it runs."""
        dst.copy_(src, non_blocking=True)

    def mark(self) -> None:
        """An event after everything queued so far (the uploads just made, a plan's copy)."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._event = event

    def wait(self) -> None:
        """Block the host until the last marked uploads ran: the buffers may be rewritten."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
