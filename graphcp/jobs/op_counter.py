"""Counting the ops a piece of host code dispatches (what each path launches): used by
``graphcp run``'s table, the GPU check's launch counts and the graph benchmarks."""

from __future__ import annotations


class OpCounter:
    """Counts ops dispatched on the host while active (what each path launches)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count = 0
        self._mode = _Mode()

    def __enter__(self):
        self.count = 0
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False
