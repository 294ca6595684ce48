"""Count the bytes a rank's collectives move, from the collective calls themselves.

``with CollectiveBytes(rank, size) as c: ...`` watches every ``c10d`` collective
dispatched while it is active (eagerly: a graph replay hides its ops) and adds up
what this rank sends to and receives from other ranks, as bandwidth-optimal
algorithms move it: an all-gather sends the rank's block to each of the C - 1 others
and receives theirs; a reduce-scatter (ring) sends and receives ``(C - 1) / C`` of its
input; an all-to-all sends the rows addressed to other ranks and receives the rows
they address to it (from its split sizes); an all-reduce (ring) sends and receives
``2 (C - 1) / C`` of its tensors. C and the rank are the collective's own process
group's (a sub-group of the mesh: graphcp.mesh), read from the call. Broadcast is
counted by kind only (``other``). Used by the tests and benchmarks to check the figures the
runtime reports (``ForwardInfo.stats``) against what its collectives did.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_NAMESPACES = ("c10d", "_c10d_functional")


class CollectiveBytes(TorchDispatchMode):
    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.rank, self.size = rank, size
        self.sent = 0
        self.received = 0
        self.calls: Counter = Counter()  # collective name -> calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in _NAMESPACES:
            self._count(func.__name__.split(".")[0], args)
        return func(*args, **kwargs)

    def _group(self, args: tuple) -> tuple[int, int]:
        """(rank, size) in the call's process group (the constructor's when none is found)."""
        for a in args:
            if isinstance(a, torch.ScriptObject):  # the dispatcher's boxed ProcessGroup (or a ReduceOp)
                try:
                    pg = dist.ProcessGroup.unbox(a)
                except (RuntimeError, TypeError, AttributeError):
                    continue
                return pg.rank(), pg.size()
        return self.rank, self.size

    def _count(self, name: str, args: tuple) -> None:
        self.calls[name] += 1
        rank, size = self._group(args)
        if name == "_allgather_base_":
            out, inp = args[0], args[1]
            self.sent += inp.nbytes * (size - 1)
            self.received += out.nbytes - inp.nbytes
        elif name == "_reduce_scatter_base_":
            out, inp = args[0], args[1]
            self.sent += inp.nbytes - out.nbytes
            self.received += inp.nbytes - out.nbytes
        elif name == "alltoall_base_":
            out, inp, out_splits, in_splits = args[0], args[1], args[3], args[4]
            row = inp.nbytes // inp.shape[0] if inp.shape[0] else 0
            out_row = out.nbytes // out.shape[0] if out.shape[0] else 0
            self.sent += (sum(in_splits) - in_splits[rank]) * row
            self.received += (sum(out_splits) - out_splits[rank]) * out_row
        elif name == "allreduce_":
            nbytes = 2 * (size - 1) * sum(t.nbytes for t in args[0]) // size
            self.sent += nbytes
            self.received += nbytes
        else:
            self.calls["other"] += 1
