"""One rank's host path with the model taken out: the layout, the KV cache (replicated
or token-sharded), the batch preparer and the static buffers, built at tiny head
dimensions so that any batch shape fits in memory. What the host-cost benchmarks
time is the engine's own code (``BatchPreparer.prepare``, ``StaticBuffers.fill``,
``BatchPreparer.abort``), only the tensors are small. :func:`decode_host_stack` is a
decode step's: the decode planner, the decode graphs' page bucket and buffers' fill,
and what the decoder does after the replay on the host (the handles, the record)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphcp.attention.kv_exchange import make_exchange
from graphcp.attention.phase import DECODE
from graphcp.attention.ring.hardware import HardwareSpec
from graphcp.attention.ring.plan import RingPlanner
from graphcp.cp import ZigzagLayout
from graphcp.dist import CPGroup
from graphcp.kv.factory import make_cache
from graphcp.kv.spec import KVHeads, PoolSpec
from graphcp.runtime.batch import BatchPreparer, ForwardInfo, Request
from graphcp.runtime.capture.phases import page_bucket
from graphcp.runtime.capture.static_buffers import DecodeBuffers, StaticBuffers
from graphcp.runtime.decode.plan import DecodePlanner
from graphcp.runtime.stats import Recorder

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


@dataclass
class DecodeHostStack:
    """A decode step's host path over ``handles`` (requests whose KV the cache holds)."""

    planner: DecodePlanner
    buffers: DecodeBuffers
    recorder: Recorder
    handles: list
    capacity: int  # the batch-size bucket

    def step(self, tokens: np.ndarray) -> list:
        """Everything the host does for one decode step on its graph: the preparation, the
        page bucket and the fill before the replay; the handles and the record after it;
        then the undo (the requests stay as they were)."""
        prep = self.planner.prepare(self.handles, tokens)
        kv = self.planner.kv
        width = page_bucket(kv.pages_for(kv.most_held(prep.decode.rows)), kv.table_width)
        self.buffers.fill(prep, self.capacity, width, kv)
        handles = [kv.handle(s) for s in prep.seq_ids]
        self.recorder.record(prep, ForwardInfo("graph", self.capacity, prep.rows, phase=DECODE, launches=1))
        self.planner.abort(prep)
        return handles


def decode_host_stack(num_requests: int, context: int) -> DecodeHostStack:
    """A replicated cache at CP 1 holding ``num_requests`` requests of ``context`` tokens
    (reserved by a prefill's preparation, never run) and a decode step's host path."""
    st = host_stack(1, False, num_requests, context)
    kv = st.preparer.kv
    handles = [kv.handle(s) for s in st.preparer.prepare(batch_of(num_requests, context)).seq_ids]
    planner = DecodePlanner(kv, CPGroup(), VOCAB, context + 64, torch.device("cpu"), lambda rows: "local", False)
    capacity = 1 << max(num_requests - 1, 0).bit_length()
    buffers = DecodeBuffers(capacity, kv.table_width, 1, torch.float32, "cpu")
    recorder = Recorder(make_exchange(kv, CPGroup(), torch.device("cpu"), lambda: None, lambda: None), 1)
    return DecodeHostStack(planner, buffers, recorder, handles, capacity)
