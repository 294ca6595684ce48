"""Host-to-device uploads from pinned memory, without blocking the host.

A copy from pageable memory (``tensor.to(device)``, ``copy_`` with ``non_blocking=False``)
is ``cudaMemcpyAsync`` followed by ``cudaStreamSynchronize`` (torch's
``aten/src/ATen/native/cuda/Copy.cu``): the host waits for every kernel queued before it.
A forward's host arrays (attention metadata, pages, rows, indices) therefore go through
:func:`to_device`, once each a forward: a pinned block of torch's caching host allocator,
queued with ``non_blocking=True``; the allocator records an event on the stream and does
not hand the block out again until the copy ran, so the array may be rewritten at once.
Tests count these uploads through a fake (:func:`uploads_through`).

Static buffers a graph reads are rewritten in place every replay, from pinned copies,
fenced: a pinned-to-device copy reads its source when it *runs*, not when it is queued,
so a host that rewrites the buffer for the next batch before the queued copy ran sends
the next batch's values with this one's launch. Whoever rewrites a pinned buffer marks
an event after its copies (``mark``) and waits on it before the next rewrite (``wait``).

Two users: the runtime's static input buffers (:class:`~graphcp.runtime.capture.static_buffers.StaticBuffers`
stages token ids, positions and slots in pinned copies), and FlashInfer's ``plan``,
which uploads its tile schedule from a per-wrapper pinned buffer with ``cudaMemcpyAsync``
(``scheduler.cuh``). Only the last pipeline stage synchronises the host each forward
(``.cpu()`` of the logits); an earlier stage's host runs ahead into the next micro-batch.

Tests pass a fake engine with the same four methods that defers every upload until a
wait or a sync (``tests/fake_copy_engine.py``), so the race shows on the CPU.

The other way, a decode step brings only its next-token ids (and stop flags) to the host,
through :class:`PinnedDownload`: a non-blocking copy into a pinned buffer the caller waits
for by polling an event (a watchdog bounds that wait), never a pageable ``.cpu()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import numpy as np
import torch


class Uploads(Protocol):
    def to_device(self, array: np.ndarray, device: torch.device | str) -> torch.Tensor: ...


class PinnedUploads:
    """The uploads of a forward's host arrays (the module doc): on a CPU device the array
    itself, without a copy."""

    def to_device(self, array: np.ndarray, device: torch.device | str) -> torch.Tensor:
        src = torch.from_numpy(array)
        if device == "cpu" or getattr(device, "type", None) == "cpu":
            return src
        pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        pinned.copy_(src)
        return pinned.to(device, non_blocking=True)


_uploads: Uploads = PinnedUploads()


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``array`` (numpy) on ``device``, queued without blocking the host (the module doc)."""
    return _uploads.to_device(array, device)


def to_device_packed(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """1-D integer ``arrays`` on ``device`` as int64 views of one upload (:func:`to_device`)."""
    flat = np.concatenate([a.astype(np.int64, copy=False).reshape(-1) for a in arrays])
    return list(torch.split(to_device(flat, device), [a.size for a in arrays]))


@contextmanager
def uploads_through(uploads: Uploads) -> Iterator[Uploads]:
    """Every :func:`to_device` inside goes through ``uploads`` (tests count them with a fake)."""
    global _uploads
    before, _uploads = _uploads, uploads
    try:
        yield uploads
    finally:
        _uploads = before


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


class PinnedDownload:
    """Small int64 device results to the host without a blocking copy (a decode step's
    next tokens): :meth:`start` queues the copy into a pinned buffer (CUDA; on a CPU the
    tensor is host memory already and comes back as is); the caller waits until the stream
    ran it (an event recorded after the copy) before reading the returned view. The
    buffer is reused: the next ``start`` comes after that wait."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def start(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda":
            return t
        n = t.numel()
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
        host = self._buf[:n].view(t.shape)
        host.copy_(t, non_blocking=True)
        return host
