"""Graph backends: record a region of eager torch code once, replay it many times.

One interface, two backends:

- ``cuda``: ``torch.cuda.CUDAGraph`` segments captured on a side stream, every
  segment of every bucket in one shared memory pool.
- ``trace``: the CPU stand-in with CUDA-graph semantics. While a segment is
  recorded, a ``TorchDispatchMode`` logs every dispatched op (``c10d`` and
  ``_c10d_functional`` collectives included) with the very tensors it read and
  wrote. Replay re-executes the log on those tensors with every non-tensor
  argument frozen at its capture-time value, and copies each op's result into
  the tensor capture recorded as its output, so replay writes the same storage
  every time. A Python value read from the live batch during capture stays baked
  in, a host sync (``.item()``) or a data-dependent shape inside a segment is an
  error: the bugs a CUDA graph would have show up on a CPU machine.

Collectives: a ``c10d`` op returns a work handle; replay waits on it. Whatever
the handle's ``wait`` dispatches (gloo's reduce_scatter copies out of a
temporary there) belongs to the collective, so callers wait with the dispatch
modes paused (:func:`graphcp.dist.wait_work`) and the log holds the collective alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from graphcp.errors import ConfigError, GraphcpError
from graphcp.options import GRAPH_BACKENDS


class CaptureError(GraphcpError, RuntimeError):
    """A body that cannot be captured, or a capture whose replay differs from eager."""


class GraphSegment(ABC):
    """One captured region. ``begin``/``end`` bracket the eager code to record."""

    @abstractmethod
    def begin(self) -> None: ...

    @abstractmethod
    def end(self) -> None: ...

    @abstractmethod
    def replay(self) -> None: ...

    @property
    def num_ops(self) -> int | None:
        """Recorded ops (trace) or graph nodes (cuda), when known."""
        return None


class GraphBackend(ABC):
    name: str = "base"

    @abstractmethod
    def new_segment(self) -> GraphSegment: ...

    def capture_stream(self):
        """Context manager the whole capture of a bucket runs under."""
        return _null()

    def synchronize(self) -> None:
        pass

    def pool_bytes(self) -> int:
        return 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- trace backend (CPU stand-in) -------------------------------------------------
_aten = torch.ops.aten
#: ops a CUDA graph cannot hold: a host read of a device value, data-dependent shapes
FORBIDDEN = {
    _aten._local_scalar_dense.default: "reads a tensor value on the host (.item(), int(t), bool(t))",
    _aten.nonzero.default: "has a data-dependent output shape",
    _aten.masked_select.default: "has a data-dependent output shape",
    _aten.equal.default: "reads a comparison of tensor values on the host (torch.equal)",
}
#: collectives write their outputs in place (or return their input, as wait_tensor
#: does) with schemas that declare no mutation: always replayed
COMMUNICATION = ("c10d", "_c10d_functional")
#: allocations whose contents are undefined: nothing to redo on replay
UNINITIALISED = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default}


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def replays_as_nothing(func, inputs: list[torch.Tensor], outs: list[torch.Tensor]) -> bool:
    """Whether a recorded op can be skipped at replay: an uninitialised allocation,
    or an op that mutates nothing and returns only tensors that share storage with
    its inputs (a view, or an input itself). Decided by fact, never by the schema:
    ``x.float()`` arrives as ``aten.to.dtype`` whose schema says "may alias", and it
    copies when the dtype changes (as ``reshape``, ``contiguous``, ``type_as`` and
    ``to(device)`` sometimes do); skipping such a copy replays stale capture data."""
    if func in UNINITIALISED:
        return True
    schema = getattr(func, "_schema", None)
    if schema is None or schema.is_mutable or not outs:
        return False
    if func.namespace in COMMUNICATION:
        return False
    shared = _storages(inputs)
    return all(o.numel() == 0 or o.untyped_storage().data_ptr() in shared for o in outs)


def _is_work(x) -> bool:
    return not isinstance(x, torch.Tensor) and hasattr(x, "wait")


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    outs: list  # the tensors capture produced (the storage replay writes into)
    skip: bool  # views and uninitialised allocations replay as nothing

    def run(self) -> None:
        res = self.func(*self.args, **self.kwargs)
        flat, _ = tree_flatten(res)
        ti = 0
        for x in flat:
            if isinstance(x, torch.Tensor):
                cap = self.outs[ti]
                ti += 1
                if x is not cap and x.data_ptr() != cap.data_ptr():
                    cap.copy_(x)
            elif _is_work(x):
                x.wait()  # a c10d work handle: eager code waits on it outside the dispatcher


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list[_Op]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = FORBIDDEN.get(func)
        if why is not None:
            raise CaptureError(f"{func} inside a captured segment {why}; a CUDA graph cannot capture it")
        res = func(*args, **kwargs)
        flat, _ = tree_flatten(res)
        outs = [x for x in flat if isinstance(x, torch.Tensor)]
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        skip = replays_as_nothing(func, inputs, outs)
        self.ops.append(_Op(func, args, kwargs, outs, skip))
        return res


class TraceSegment(GraphSegment):
    def __init__(self) -> None:
        self._log: list[_Op] = []
        self._ops: list[_Op] = []
        self._mode: _Recorder | None = None

    def begin(self) -> None:
        if self._mode is not None:
            raise CaptureError("segment already recording")
        self._mode = _Recorder(self._log)
        self._mode.__enter__()

    def end(self) -> None:
        if self._mode is None:
            raise CaptureError("segment not recording")
        self._mode.__exit__(None, None, None)
        self._mode = None
        self._ops = [op for op in self._log if not op.skip]

    def replay(self) -> None:
        # one unit, as a CUDA graph launch is: outer dispatch modes (op counters) see none of its ops
        with _disable_current_modes():
            for op in self._ops:
                op.run()

    @property
    def num_ops(self) -> int:
        return len(self._ops)


class TraceBackend(GraphBackend):
    name = "trace"

    def new_segment(self) -> GraphSegment:
        return TraceSegment()


# ---- CUDA backend -------------------------------------------------------------------
class CudaSegment(GraphSegment):
    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def begin(self) -> None:
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        self.graph.capture_end()

    def replay(self) -> None:
        self.graph.replay()


class CudaBackend(GraphBackend):
    """All segments of all buckets share one pool; capture runs on a side stream."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("RuntimeConfig.graph_backend='cuda' needs a CUDA device; use 'trace' on a CPU machine")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)

    def new_segment(self) -> GraphSegment:
        return CudaSegment(self.pool)

    def capture_stream(self):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def pool_bytes(self) -> int:
        """Bytes of the graphs' own memory pool: the caching allocator's segments owned by
        it on this device (``memory_reserved`` would count every pool and the eager
        allocations too)."""
        return pool_segment_bytes(torch.cuda.memory_snapshot(include_traces=False), tuple(self.pool),
                                  self.device.index if self.device.index is not None else torch.cuda.current_device())


def pool_segment_bytes(snapshot: list[dict], pool: tuple[int, int], device: int) -> int:
    """The cudaMalloc'd bytes (``total_size``) of a memory snapshot's segments that belong
    to ``pool`` (``segment_pool_id``) on ``device``."""
    return sum(int(s["total_size"]) for s in snapshot
               if tuple(s.get("segment_pool_id", ())) == tuple(pool) and s.get("device", device) == device)


def make_graph_backend(name: str, device: torch.device) -> GraphBackend:
    if name not in GRAPH_BACKENDS:
        raise ConfigError(f"RuntimeConfig.graph_backend must be one of {', '.join(GRAPH_BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "trace"
    if name == "trace":
        return TraceBackend()
    if device.type != "cuda":
        raise ConfigError(f"RuntimeConfig.graph_backend='cuda' needs device cuda, this engine runs on {device}")
    return CudaBackend(device)
