"""The two hardware figures the per-batch exchange choice reads, and helpers that
measure them on the machine at hand.

Defaults (H100 / H200 SXM, NVLink 4): 989 TFLOP/s of dense bfloat16 matmul (the
figure NVIDIA's H100 SXM datasheet gives without sparsity; H200 has the same SMs
and clocks) and 450 GB/s per direction per GPU (NVLink 4: 18 links x 25 GB/s per
direction, 900 GB/s bidirectional). Attention reaches a fraction of the matmul
peak, and a ring step a fraction of the link; only the ratio of the two enters
the rule (see :mod:`graphcp.attention.ring.exchange_choice`), so measured figures from
:func:`measure_peak_tflops` and :func:`measure_link_gb_per_s` on the deployment
(``RuntimeConfig.peak_tflops`` / ``link_gb_per_s``) are what to use there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from graphcp.checks import check_float

#: H100/H200 SXM: dense bf16 tensor-core peak (TFLOP/s) and NVLink 4 bandwidth per direction (GB/s)
H100_PEAK_TFLOPS = 989.0
H100_NVLINK_GB_PER_S = 450.0


@dataclass(frozen=True)
class HardwareSpec:
    """Peak attention FLOP/s of one GPU and its link bandwidth per direction."""

    peak_tflops: float = H100_PEAK_TFLOPS
    link_gb_per_s: float = H100_NVLINK_GB_PER_S

    def __post_init__(self) -> None:
        check_float(self.peak_tflops, "peak_tflops", lo=0, lo_open=True, where="HardwareSpec")
        check_float(self.link_gb_per_s, "link_gb_per_s", lo=0, lo_open=True, where="HardwareSpec")

    @property
    def flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def bytes_per_s(self) -> float:
        return self.link_gb_per_s * 1e9


def _seconds(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn()`` (synchronised on CUDA)."""
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return times[len(times) // 2]


def measure_peak_tflops(device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16, n: int = 8192,
                        repeats: int = 5) -> float:
    """TFLOP/s of an ``n x n`` matmul in ``dtype`` on ``device`` (an upper bound for
    attention; use a smaller ``n`` on a CPU)."""
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    return 2 * n**3 / _seconds(lambda: torch.matmul(a, b), dev, repeats) / 1e12


def measure_link_gb_per_s(group, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """GB/s one rank receives from its ring neighbour (``send_recv`` of ``nbytes``, what
    a ring step does); every rank of ``group`` must call it. 0 for a one-rank group."""
    if not group.distributed:
        return 0.0
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and \
        torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    send = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    recv = torch.empty_like(send)
    nxt, prv = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    return nbytes / _seconds(lambda: group.send_recv(send, nxt, recv, prv).wait(), dev, repeats) / 1e9
