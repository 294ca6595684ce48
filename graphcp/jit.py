"""Compiled host kernels: the per-forward host path's loops, compiled by numba.

On the graph path the host's work before the first launch is the part graphcp
controls, and a numpy call costs 0.4-1 us however small its array: a plan and a
rank's metadata written as array operations are a hundred such calls (~70 us for
16 requests at C = 8). The same loops compiled are one call each (~0.5 us to enter,
nanoseconds a block or a token): the host path of docs/performance.md.

``host_kernel`` is the one decorator (and the one home of its options): numba's
``njit`` with an on-disk cache (the first call of a fresh install compiles, ~0.5 s
a kernel; later processes load it) and no bounds checks (callers pass arrays the
kernels' docstrings size). Kernels take preallocated outputs and plain integers,
write what they say, and use only what numba compiles (loops, scalar arithmetic,
array indexing).

numba is a dependency (pyproject). Where it is missing (a GPU image that lacks it)
the kernels run as the plain Python they are written in: the same results, at
Python's speed (about a microsecond a token); :data:`COMPILED` says which.
"""

from __future__ import annotations

import warnings
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

try:
    from numba import njit
except ImportError:  # the interpreted fallback (see the module doc)
    njit = None

#: whether the host kernels are compiled (numba imported)
COMPILED = njit is not None

if not COMPILED:
    warnings.warn("numba is not installed: graphcp's host kernels run as Python (correct, much slower); "
                  "pip install numba", RuntimeWarning, stacklevel=2)


def host_kernel(fn: F) -> F:
    """Compile ``fn`` for the host path (see the module doc); ``fn`` itself without numba."""
    if njit is None:
        return fn
    return njit(cache=True, nogil=True, boundscheck=False)(fn)
