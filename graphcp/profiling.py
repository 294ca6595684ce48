"""NVTX ranges (the ``nvtx`` package: works without a GPU, ~0.2 us a range) that
also feed ``torch.profiler`` when one is recording, so an ``nsys`` timeline and a
CPU Chrome trace carry the same names.

Everything graphcp marks lives in the NVTX domain ``graphcp``; the category says
which kind of range it is (see profiles/README.md for the naming scheme).
"""

from __future__ import annotations

import nvtx
import torch

DOMAIN = "graphcp"
CATEGORIES = ("host", "graph", "segment", "break", "comm", "eager", "capture", "output")

_domain = nvtx.get_domain(DOMAIN)
_attr_cache: dict[tuple[str, str], object] = {}


class nvtx_range:
    """``with nvtx_range("replay", category="graph"):`` - one NVTX push/pop, plus a
    ``torch.profiler`` record_function while a profiler is recording."""

    __slots__ = ("_attrs", "_name", "_rf")

    def __init__(self, name: str, category: str = "host") -> None:
        key = (name, category)
        attrs = _attr_cache.get(key)
        if attrs is None:
            attrs = _domain.get_event_attributes(message=name, category=category)
            _attr_cache[key] = attrs
        self._attrs = attrs
        self._name = name
        self._rf = None

    def __enter__(self) -> "nvtx_range":
        _domain.push_range(self._attrs)
        if torch.autograd._profiler_enabled():
            self._rf = torch.profiler.record_function(f"{DOMAIN}:{self._name}")
            self._rf.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._rf is not None:
            self._rf.__exit__(*exc)
            self._rf = None
        _domain.pop_range()
