"""The host path without numba (a GPU image that lacks it): one rank's whole preparation,
fill and undo (``host_stack.HostStack``) with the per-token kernels' numpy twins
(graphcp/jit.py ``fallback``) and the other kernels as Python, for one request of 1K, 8K
and 32K tokens at C = 1 and 256 requests of 512 tokens at C = 8. Run it on its own (numba
must not be imported by graphcp before this module hides it):

    python -m pytest benchmarks/bench_host_no_numba.py --benchmark-only

The compiled path's figures are bench_host_scaling.py's.
"""

from __future__ import annotations

import sys
import warnings

import pytest

if "graphcp.jit" not in sys.modules:
    sys.modules["numba"] = None  # the image without numba
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        import graphcp.jit  # noqa: F401

from host_stack import batch_of, host_stack  # noqa: E402

from graphcp import jit  # noqa: E402

#: (requests, tokens a request, CP size)
CASES = ((1, 1024, 1), (1, 8192, 1), (1, 32768, 1), (256, 512, 8))


@pytest.mark.parametrize("requests,tokens,cp", CASES)
def test_host_path_without_numba(benchmark, requests, tokens, cp):
    if jit.COMPILED:
        pytest.skip("graphcp.jit was imported with numba before this module: run it on its own")
    stack = host_stack(cp, False, requests, tokens)
    batch = batch_of(requests, tokens)
    benchmark.group = "host path without numba"
    benchmark.pedantic(stack.prepare_fill_abort, (batch,), rounds=20, warmup_rounds=2)
    benchmark.extra_info.update(requests=requests, tokens=tokens, cp=cp)
