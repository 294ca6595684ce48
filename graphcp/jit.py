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
a kernel that walks every token has a vectorised numpy twin (``fallback``: the same
results, a few numpy calls whatever the token count), and the others run as the plain
Python they are written in (their loops are per request, block or page); the same
results either way, and :data:`COMPILED` says which.
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


#: every compiled host kernel defined so far (numba dispatchers; empty without numba): what
#: a caller that must not compile later (graphcp gpu-check) counts after warming them
KERNELS: list = []


def compiled_count() -> tuple[int, int, list[str]]:
    """(kernels compiled or loaded so far, kernels defined, the names of those not yet)."""
    left = [k.__name__ for k in KERNELS if not k.signatures]
    return len(KERNELS) - len(left), len(KERNELS), left


def host_kernel(fn: F | None = None, *, fallback: Callable | None = None):
    """Compile ``fn`` for the host path (see the module doc). Without numba: ``fallback``
    where given (a vectorised numpy form taking the same arguments and writing the same
    results; the tests hold them equal), else ``fn`` itself as Python. Use as
    ``@host_kernel`` or ``@host_kernel(fallback=...)``."""
    def wrap(f: F) -> F:
        if njit is None:
            return fallback if fallback is not None else f
        kernel = njit(cache=True, nogil=True, boundscheck=False)(f)
        KERNELS.append(kernel)
        return kernel

    return wrap if fn is None else wrap(fn)
