"""A rank's linear-layer blocks as one variable-length batch: the layouts the local
kernels read (graphcp.model.hybrid.kernels), built on the host with the forward's plan
and uploaded with it in one packed copy (graphcp.model.hybrid.scan).

A rank's blocks are consecutive runs of its live rows (zigzag's segments; on one rank a
request's two segments are adjacent), so the rows themselves are the flat batch:
``cu_seqlens`` ``[nb + 1]`` are the blocks' bounds, and nothing is padded to the longest
block. What each kernel reads besides:

- fla's chunked rule: ``cu_seqlens`` (int64 on the device, and the same on the host:
  ``cu_seqlens_cpu``) and ``chunk_indices`` ``[chunks, 2]`` (each 64-token chunk's block
  and its index in the block, what fla would otherwise build from the host copy);
- the torch rule: :class:`ChunkSlots`, each block cut into 64-token chunks (a block's
  last one padded with zero rows), the chunks of all blocks in step-major order so that
  step ``i`` of the recurrence is one contiguous slice;
- both convolutions: :class:`ConvRows`, each block's ``K - 1`` halo rows followed by its
  own rows in one extended sequence (``ext``: rows of the convolution's source), the
  block of each (``seq``: causal-conv1d's ``seq_idx``) and where each live row is in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from graphcp.jit import host_kernel


def chunk_indices(cu: np.ndarray, chunk: int) -> np.ndarray:
    """fla's ``chunk_indices`` of blocks ``cu``: ``[chunks, 2]`` (block, chunk of the block)."""
    counts = -(-np.diff(cu) // chunk)
    block = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    index = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([block, index], axis=1)


@dataclass(frozen=True)
class SlotPlan:
    """The torch rule's chunks of blocks ``cu`` (host side of :class:`ChunkSlots`): the
    blocks sorted by their chunk count (most first), so that the blocks still running at
    step ``i`` are the first ``steps[i + 1] - steps[i]`` of them; slot ``steps[i] + j``
    holds chunk ``i`` of the ``j``-th of them."""

    rows: np.ndarray  # [slots * chunk] the live row of each slot position (n: a zero row)
    position: np.ndarray  # [n] each live row's slot position
    order: np.ndarray  # [nb] the blocks, most chunks first
    inverse: np.ndarray  # [nb] each block's place in order
    steps: tuple[int, ...]  # [max chunks + 1] where each step's slots start

    @classmethod
    def build(cls, cu: np.ndarray, chunk: int) -> "SlotPlan":
        counts = -(-np.diff(cu) // chunk)
        order = np.argsort(-counts, kind="stable").astype(np.int64)
        inverse = np.argsort(order, kind="stable").astype(np.int64)
        running = (counts[None, :] > np.arange(int(counts.max(initial=0)))[:, None]).sum(axis=1)
        steps = np.concatenate([[0], np.cumsum(running)]).astype(np.int64)
        rows = np.empty(int(steps[-1]) * chunk, dtype=np.int64)
        position = np.empty(int(cu[-1]), dtype=np.int64)
        _slot_rows(cu, order, inverse, steps, chunk, rows, position)
        return cls(rows, position, order, inverse, tuple(int(s) for s in steps))


def _slot_rows_np(cu: np.ndarray, order: np.ndarray, inverse: np.ndarray, steps: np.ndarray, chunk: int,
                  rows: np.ndarray, position: np.ndarray) -> None:
    """:func:`_slot_rows` vectorised (what runs without numba)."""
    lens, n = np.diff(cu), int(cu[-1])
    running = np.diff(steps)
    step = np.repeat(np.arange(len(running), dtype=np.int64), running)
    block = order[np.arange(int(steps[-1]), dtype=np.int64) - np.repeat(steps[:-1], running)]
    row = cu[block][:, None] + step[:, None] * chunk + np.arange(chunk, dtype=np.int64)[None, :]
    rows[:] = np.where(row < cu[block + 1][:, None], row, n).reshape(-1)
    of_row = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
    offset = np.arange(n, dtype=np.int64) - np.repeat(cu[:-1], lens)
    position[:] = (steps[offset // chunk] + inverse[of_row]) * chunk + offset % chunk


@host_kernel(fallback=_slot_rows_np)
def _slot_rows(cu: np.ndarray, order: np.ndarray, inverse: np.ndarray, steps: np.ndarray, chunk: int,
               rows: np.ndarray, position: np.ndarray) -> None:
    """Write ``rows`` ``[slots * chunk]`` (each slot position's live row; ``n``, a zero row,
    past its block's end) and ``position`` ``[n]`` (each live row's slot position): slot
    ``steps[i] + j`` holds chunk ``i`` of block ``order[j]``."""
    n = cu[len(cu) - 1]
    for i in range(len(steps) - 1):
        for j in range(steps[i + 1] - steps[i]):
            b = order[j]
            base = (steps[i] + j) * chunk
            start = cu[b] + i * chunk
            stop = min(start + chunk, cu[b + 1])
            for t in range(chunk):
                if start + t < stop:
                    rows[base + t] = start + t
                    position[start + t] = base + t
                else:
                    rows[base + t] = n


@dataclass(frozen=True)
class ChunkSlots:
    """The torch rule's chunk layout on the device (:class:`SlotPlan`'s arrays)."""

    rows: torch.Tensor
    position: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor
    steps: tuple[int, ...]


@dataclass(frozen=True)
class FlaSegments:
    """fla's variable-length batch: the blocks' bounds on the device and the host, and
    its chunk indices (so fla reads nothing back from the device)."""

    cu_seqlens: torch.Tensor  # int64 [nb + 1], device
    cu_seqlens_cpu: torch.Tensor  # int64 [nb + 1], host
    chunk_indices: torch.Tensor  # int64 [chunks, 2], device


def conv_rows(cu: np.ndarray, halo: np.ndarray, live_at: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each block's extended sequence, its halo (``halo`` ``[nb, K - 1]``: rows of the
    convolution's source) then its own rows (live row ``r`` is source row ``live_at + r``):
    ``(ext, seq, keep)``: the source row of each extended position, its block, and the
    position of each live row."""
    nb, width = halo.shape
    n = int(cu[-1])
    ext, seq = np.empty(n + nb * width, dtype=np.int64), np.empty(n + nb * width, dtype=np.int64)
    keep = np.empty(n, dtype=np.int64)
    _conv_rows(cu, np.ascontiguousarray(halo, dtype=np.int64), live_at, ext, seq, keep)
    return ext, seq, keep


def _conv_rows_np(cu: np.ndarray, halo: np.ndarray, live_at: int, ext: np.ndarray, seq: np.ndarray,
                  keep: np.ndarray) -> None:
    """:func:`_conv_rows` vectorised (what runs without numba)."""
    lens = np.diff(cu)
    nb, width = halo.shape
    ext_lens = lens + width
    starts = np.cumsum(ext_lens) - ext_lens
    own = np.arange(int(ext_lens.sum()), dtype=np.int64) - np.repeat(starts, ext_lens)  # offset in the block
    seq[:] = np.repeat(np.arange(nb, dtype=np.int64), ext_lens)
    row = np.clip(own - width, 0, None) + np.repeat(cu[:-1], ext_lens)
    ext[:] = np.where(own < width, halo[seq, np.minimum(own, width - 1)], live_at + row)
    keep[:] = np.repeat(starts + width, lens) + np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], lens)


@host_kernel(fallback=_conv_rows_np)
def _conv_rows(cu: np.ndarray, halo: np.ndarray, live_at: int, ext: np.ndarray, seq: np.ndarray,
               keep: np.ndarray) -> None:
    """Write :func:`conv_rows`' arrays (``ext``, ``seq`` ``[n + nb (K - 1)]``, ``keep`` ``[n]``)."""
    p = 0
    for b in range(halo.shape[0]):
        for j in range(halo.shape[1]):
            ext[p] = halo[b, j]
            seq[p] = b
            p += 1
        for r in range(cu[b], cu[b + 1]):
            ext[p] = live_at + r
            seq[p] = b
            keep[r] = p
            p += 1


@dataclass
class ConvRows:
    """:func:`conv_rows` on the device (``kernel``: the convolution's ``K``)."""

    ext: torch.Tensor
    seq: torch.Tensor | None
    keep: torch.Tensor
    kernel: int
    _outputs: torch.Tensor | None = field(default=None, repr=False)

    def outputs(self) -> torch.Tensor:
        """Where each live row's output is among the outputs of every extended position
        from ``K - 1`` on (the torch convolution's, graphcp.model.hybrid.gdn.conv_rows):
        made once a forward."""
        if self._outputs is None:
            self._outputs = self.keep - (self.kernel - 1)
        return self._outputs
