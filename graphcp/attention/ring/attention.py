"""The ring attention of a token-sharded cache: one object per engine, holding the
backends of the ring's steps 1 .. C-1 (step 0 is the engine's own backend) and the
ring's buffers (reserved per bucket at capture, grow-only on the eager path). Each
forward's :class:`RingPlan` is live metadata: the ring runs in the attention break
(eagerly, also when the body replays a graph)."""

from __future__ import annotations

from typing import Callable

import torch

from graphcp.attention.base import AttentionBackend
from graphcp.attention.ring import pass_kv, pass_q
from graphcp.attention.ring.buffers import RingBuffers
from graphcp.attention.ring.pass_kv import run_pass_kv
from graphcp.attention.ring.pass_q import run_pass_q
from graphcp.attention.ring.plan import RingPlan

RINGS = {"pass-kv": run_pass_kv, "pass-q": run_pass_q}


class RingAttention:
    def __init__(self, make_backend: Callable[[], AttentionBackend], group, device: torch.device | str,
                 exchanges: tuple[str, ...] = tuple(RINGS)) -> None:
        """``make_backend()`` builds one step's backend (each step has its own plan);
        ``exchanges``: the rings a forward may run (what :meth:`reserve` sizes for)."""
        self.group = group
        self.steps = [make_backend() for _ in range(group.size - 1)]
        self.buffers = RingBuffers(device)
        self.exchanges = exchanges

    def reserve(self, capacity: int, kv_layer: torch.Tensor, heads: int, dim: int, q_dtype: torch.dtype) -> None:
        """Allocate every buffer a forward of up to ``capacity`` local rows can need (at a
        bucket's capture), so that a replay allocates nothing whatever its batch: the
        row buffers for the bucket, and pass-KV's two staging buffers for a message of a
        whole pool (``kv_layer``: one layer of this rank's pool; a message holds at most
        its pages), i.e. two layers of the pool a rank."""
        C = self.group.size
        if C == 1:
            return
        specs = {}
        if "pass-kv" in self.exchanges:
            specs.update(pass_kv.buffers(capacity, kv_layer.shape[0] - 1, heads, dim, q_dtype,
                                         tuple(kv_layer.shape[1:]), kv_layer.dtype))
        if "pass-q" in self.exchanges:
            specs.update(pass_q.buffers(capacity, C * capacity, capacity, C, heads, dim, q_dtype))
        for name, (shape, dtype) in specs.items():
            self.buffers.get(name, shape, dtype)

    def prepare(self, ring: RingPlan) -> None:
        """Host-side planning of steps 1 .. C-1 for one forward (step 0: the engine's backend)."""
        for backend, meta in zip(self.steps, ring.steps[1:]):
            backend.prepare(meta)

    def attend(self, ring: RingPlan, backend: AttentionBackend, layer_kv: torch.Tensor, q: torch.Tensor,
               out: torch.Tensor) -> int:
        """Attention of this rank's rows of one layer over every rank's keys, written
        into ``out`` (``backend``: step 0's, prepared with ``ring.steps[0]``). Returns the
        bytes this rank received."""
        if not ring.live:
            return 0
        if ring.cp_size == 1:  # nothing to exchange: plain causal attention
            backend.forward(q, layer_kv, ring.steps[0], out)
            return 0
        return RINGS[ring.exchange](ring, self.group, [backend, *self.steps], layer_kv, self.buffers, q, out)
