"""Grow-only device buffers of the ring (staging KV pages, visiting queries, partial
outputs and LSEs, the merge's accumulators).

A buffer is allocated on first need and reallocated only when a batch needs more
than any before it (rounded up to a power of two elements), so in steady state a
forward allocates none of them: what a bucket's replay runs in its attention
breaks reuses them. :attr:`RingBuffers.allocations` counts the allocations.
"""

from __future__ import annotations

import math

import torch


class RingBuffers:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._bufs: dict[str, torch.Tensor] = {}
        self.allocations = 0

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape`` view of buffer ``name`` (contents undefined)."""
        numel = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            size = 1 << max(numel - 1, 0).bit_length()
            buf = self._bufs[name] = torch.empty(size, dtype=dtype, device=self.device)
            self.allocations += 1
        return buf[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())
