"""Cost of one annotated range with no profiler attached (the serving case).

Run: ``pytest benchmarks/bench_profiling.py --benchmark-only``. Each round
enters and exits ``INNER`` ranges, so the per-range cost is the mean / INNER;
compare with the empty loop. A breakable-graph forward enters 2 L + 8 ranges
(L layers), so at 0.3-0.5 us a range a 32-layer model pays 20-35 us of host time.

Cases: ``nvtx_range`` as the library calls it (a literal name, and an f-string
name as the per-layer ranges build it), the NVTX path forced on (what a range
costs in our code while nsys is attached, minus the tool's own cost: NVTX's C
calls are no-ops without a tool), the old implementation for reference, and
the empty loop.
"""

from __future__ import annotations

import pytest

from graphcp import nvtx_ranges as profiling
from graphcp.nvtx_ranges import nvtx_range

INNER = 1000


def _loop_empty() -> None:
    for _ in range(INNER):
        pass


def _loop_range() -> None:
    for _ in range(INNER):
        with nvtx_range("plan", category="host"):
            pass


def _loop_indexed_range() -> None:
    for i in range(INNER):
        with nvtx_range(f"attention[{i & 31}]", category="break"):
            pass


def _old_range_cls():
    """The implementation before this benchmark (a new object, a tuple-keyed
    attribute cache and a C++ profiler query per range)."""
    import torch

    cache: dict = {}
    domain = profiling.nvtx.get_domain(profiling.DOMAIN)

    class old_range:
        __slots__ = ("_attrs", "_name", "_rf")

        def __init__(self, name: str, category: str = "host") -> None:
            key = (name, category)
            attrs = cache.get(key)
            if attrs is None:
                attrs = cache[key] = domain.get_event_attributes(message=name, category=category)
            self._attrs, self._name, self._rf = attrs, name, None

        def __enter__(self):
            domain.push_range(self._attrs)
            if torch.autograd._profiler_enabled():
                self._rf = torch.profiler.record_function(self._name)
                self._rf.__enter__()
            return self

        def __exit__(self, *exc):
            if self._rf is not None:
                self._rf.__exit__(*exc)
                self._rf = None
            domain.pop_range()

    return old_range


@pytest.fixture
def forced_nvtx():
    """A real NVTX domain even without a tool attached (its C calls are no-ops)."""
    from nvtx._lib.lib import Domain, DomainHandle

    dom = object.__new__(Domain)
    dom.handle = DomainHandle(profiling.DOMAIN)
    dom.__init__(profiling.DOMAIN)
    before = profiling._domain
    profiling._use_domain(dom)
    yield
    profiling._use_domain(before)


def _per_range_us(benchmark) -> None:
    benchmark.extra_info["inner"] = INNER
    benchmark.extra_info["per_range_us"] = benchmark.stats.stats.mean / INNER * 1e6


def test_empty_loop(benchmark):
    benchmark(_loop_empty)
    _per_range_us(benchmark)


def test_nvtx_range_no_profiler(benchmark):
    assert profiling._handle is None and not profiling._torch_prof._is_profiler_enabled
    benchmark(_loop_range)
    _per_range_us(benchmark)


def test_nvtx_range_indexed_name(benchmark):
    benchmark(_loop_indexed_range)
    _per_range_us(benchmark)


def test_nvtx_range_nvtx_path(benchmark, forced_nvtx):
    assert profiling._handle is not None
    benchmark(_loop_range)
    _per_range_us(benchmark)


def test_old_nvtx_range(benchmark):
    old = _old_range_cls()

    def loop():
        for _ in range(INNER):
            with old("plan", "host"):
                pass

    benchmark(loop)
    _per_range_us(benchmark)
