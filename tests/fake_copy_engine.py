"""A CPU model of one CUDA stream whose pinned-to-device copies run late.

A copy from pinned host memory (``copy_(..., non_blocking=True)``, ``cudaMemcpyAsync``)
reads its source when the stream gets to it, not when the host queues it. The fake
defers every queued operation (uploads, and "kernels" a test queues with ``launch``)
until the host waits on an event past it (``mark`` / ``wait``, the fence of
:class:`graphcp.attention.staging.PinnedStaging`) or synchronises (``sync``), so a host
that rewrites a staging buffer too early is seen on the CPU: the late copy carries the
new values.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import torch


class FakeCopyEngine:
    def __init__(self) -> None:
        self.queue: list[Callable[[], object]] = []
        self.ran = 0
        self._event: int | None = None
        self.waits = 0

    def host(self, n: int, dtype: torch.dtype, fill_value: int | float = 0) -> torch.Tensor:
        return torch.full((n,), fill_value, dtype=dtype)  # "pinned": read when the copy runs

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # a strided host source is first copied to pageable memory by torch (Copy.cu's
        # temporaries): the copy would then be neither asynchronous nor fenced
        assert src.is_contiguous(), f"an upload from a strided host source {tuple(src.shape)} {src.stride()}"
        self.queue.append(lambda: dst.copy_(src))

    def launch(self, fn: Callable[[], object]) -> None:
        """Queue a kernel: it reads device tensors when it runs."""
        self.queue.append(fn)

    def mark(self) -> None:
        self._event = len(self.queue)

    def wait(self) -> None:
        if self._event is not None:
            self.waits += 1
            self._run(self._event)
            self._event = None

    def sync(self) -> None:
        self._run(len(self.queue))

    def _run(self, upto: int) -> None:
        while self.ran < upto:
            self.queue[self.ran]()
            self.ran += 1


class UploadRecorder:
    """A stand-in for :class:`graphcp.attention.staging.PinnedUploads` (install it with
    ``staging.uploads_through``): records every upload of a host array a forward makes
    through ``staging.to_device`` (its shape, dtype and the graphcp function that asked)
    and hands back a copy, as the device holds a snapshot of the array."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, str, str]] = []

    def to_device(self, array: np.ndarray, device) -> torch.Tensor:
        assert isinstance(array, np.ndarray), type(array)
        frame = sys._getframe(1)
        while frame.f_code.co_filename.endswith("staging.py"):
            frame = frame.f_back
        self.calls.append((array.shape, str(array.dtype), frame.f_code.co_name))
        return torch.from_numpy(np.array(array, copy=True))

    def sites(self) -> dict[str, int]:
        """Uploads per asking function."""
        out: dict[str, int] = {}
        for _, _, where in self.calls:
            out[where] = out.get(where, 0) + 1
        return out
