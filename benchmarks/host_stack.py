"""One rank's host path with the model taken out: the layout, the KV cache (replicated
or token-sharded), the batch preparer and the static buffers, built at tiny head
dimensions so that any batch shape fits in memory. What the host-cost benchmarks
time is the engine's own code (``BatchPreparer.prepare``, ``StaticBuffers.fill``,
``BatchPreparer.abort``), only the tensors are small."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphcp.attention.ring.hardware import HardwareSpec
from graphcp.attention.ring.plan import RingPlanner
from graphcp.cp import ZigzagLayout
from graphcp.dist import CPGroup
from graphcp.kv.factory import make_cache
from graphcp.kv.spec import KVHeads, PoolSpec
from graphcp.runtime.batch import BatchPreparer, Request
from graphcp.runtime.capture.static_buffers import StaticBuffers

PAGE_SIZE = 16  # RuntimeConfig's default
VOCAB = 32000


@dataclass
class HostStack:
    preparer: BatchPreparer
    buffers: StaticBuffers

    def prepare_fill_abort(self, batch: list[Request]) -> None:
        """Everything the host does for one forward before a replay, then the undo."""
        prep = self.preparer.prepare(batch)
        rows = prep.plan.max_local_rows
        self.buffers.fill(_bucket(rows), prep.ids, prep.positions, prep.slots)
        self.preparer.abort(prep)


def _bucket(rows: int) -> int:
    """The bucket a graph runner would pick: the next power of two (at least 256)."""
    return max(256, 1 << max(rows - 1, 0).bit_length())


def host_stack(cp_size: int, sharded: bool, num_requests: int, tokens: int, rank: int = 0, layers: int = 1,
               heads: int = 1, head_dim: int = 1) -> HostStack:
    """Rank ``rank``'s host stack, sized for ``num_requests`` requests of ``tokens`` new
    tokens each (no collective is issued: consistency checks are off); its cache holds
    ``layers`` layers of ``heads`` K/V heads of ``head_dim``."""
    per_seq = -(-tokens // PAGE_SIZE) + 1
    pages = num_requests * per_seq + 1  # room for the whole batch on any rank
    pool = PoolSpec(range(layers), pages, PAGE_SIZE, torch.float32, "cpu", per_seq, rank, cp_size)
    kv = make_cache("sharded" if sharded else "replicated", KVHeads(heads, head_dim), pool)
    planner = RingPlanner("auto", 1, 1, 1, 4, HardwareSpec()) if sharded else None
    prep = BatchPreparer(ZigzagLayout(cp_size), kv, CPGroup(rank=rank, size=cp_size), VOCAB, max_context=tokens,
                         device=torch.device("cpu"), check_consistency=False, planner=planner)
    rows = -(-num_requests * tokens // cp_size) + 2 * num_requests  # a rank's rows, with the blocks' rounding
    buffers = StaticBuffers(_bucket(rows), cp_size, 1, 1, 1, 2 * num_requests, per_seq, torch.float32, "cpu")
    return HostStack(prep, buffers)


def batch_of(num_requests: int, tokens: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(0, VOCAB, tokens)) for _ in range(num_requests)]
