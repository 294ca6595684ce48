"""The ring attention of a token-sharded cache: one object per engine, holding the
backends of the ring's steps 1 .. C-1 (step 0 is the engine's own backend) and the
ring's grow-only buffers. Each forward's :class:`RingPlan` is live metadata: the
ring runs in the attention break (eagerly, also when the body replays a graph)."""

from __future__ import annotations

from typing import Callable

import torch

from graphcp.attention.base import AttentionBackend
from graphcp.attention.ring.buffers import RingBuffers
from graphcp.attention.ring.pass_kv import run_pass_kv
from graphcp.attention.ring.pass_q import run_pass_q
from graphcp.attention.ring.plan import RingPlan

RINGS = {"pass-kv": run_pass_kv, "pass-q": run_pass_q}


class RingAttention:
    def __init__(self, make_backend: Callable[[], AttentionBackend], group, device: torch.device | str) -> None:
        """``make_backend()`` builds one step's backend (each step has its own plan)."""
        self.group = group
        self.steps = [make_backend() for _ in range(group.size - 1)]
        self.buffers = RingBuffers(device)

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
