"""The Mooncake transfer engine, as the KV transport uses it.

``mooncake-transfer-engine`` (``pip install -e ".[pd]"``; on CPU machines the
``-non-cuda`` wheel, which links the system's ``libibverbs1``). Each side runs one
engine with the P2P handshake (no metadata server: a peer is named by its session,
``host:rpc_port``), ``tcp`` on one machine or ``rdma`` where the cluster has it.
A receiver registers one buffer; a sender registers its staging buffer and writes
into the receiver's buffer with one-sided writes, polled against a deadline
(``batch_transfer_async_write`` + ``transfer_check_status``: 1 done, 0 running,
-1 failed, -2 timed out). ``transfer_check_status`` reads the status of a batch's
*first* task only (and frees the batch when that one is done), so every contiguous
run is submitted as a batch of its own: a write is done when every run's batch is.
"""

from __future__ import annotations

import importlib
import os
import time
from types import ModuleType

import torch

from graphcp.pd.errors import TransferFailed, TransferTimeout, TransportUnavailable

PD_EXTRA = 'pip install -e ".[pd]" (and, on CPU machines, apt-get install libibverbs1)'
#: Mooncake's metadata mode in which peers exchange segment descriptors directly
P2P_HANDSHAKE = "P2PHANDSHAKE"
POLL_S = 0.0005


def import_mooncake() -> ModuleType:
    """``mooncake.engine``, or TransportUnavailable saying what to install. Its log is
    set to errors only unless ``MC_LOG_LEVEL`` says otherwise (it logs every connection
    at INFO to stderr)."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        return importlib.import_module("mooncake.engine")
    except (ImportError, OSError) as e:  # the wheel, or a system library it links, is missing
        raise TransportUnavailable(f"the Mooncake transfer engine cannot be imported ({type(e).__name__}: {e}); "
                                   f"install it with {PD_EXTRA}") from e


def mooncake_problem() -> str | None:
    """Why the Mooncake transport cannot run here, or None when it can."""
    try:
        import_mooncake()
    except TransportUnavailable as e:
        return str(e)
    return None


class MooncakeEngine:
    """One transfer engine of this process: its session name, registered buffers and
    deadline-bounded writes."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "") -> None:
        self._te = import_mooncake().TransferEngine()
        rc = self._te.initialize(host, P2P_HANDSHAKE, protocol, device_name)
        if rc != 0:
            raise TransportUnavailable(f"Mooncake TransferEngine.initialize({host!r}, {P2P_HANDSHAKE!r}, {protocol!r}, "
                                       f"{device_name!r}) returned {rc}")
        self.session = f"{host}:{self._te.get_rpc_port()}"
        self._registered: dict[int, torch.Tensor] = {}

    def register(self, buf: torch.Tensor) -> int:
        """Register a contiguous tensor's memory; its address (the tensor is kept alive)."""
        addr = buf.data_ptr()
        rc = self._te.register_memory(addr, buf.numel() * buf.element_size())
        if rc != 0:
            raise TransportUnavailable(f"Mooncake register_memory of {buf.numel() * buf.element_size()} bytes "
                                       f"returned {rc}")
        self._registered[addr] = buf
        return addr

    def unregister(self, addr: int) -> None:
        if self._registered.pop(addr, None) is not None:
            self._te.unregister_memory(addr)

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int], timeout_s: float,
              what: str) -> None:
        """Write ``lengths[i]`` bytes from local ``src[i]`` (registered) to ``dst[i]`` in
        ``session``'s registered memory; returns when every byte has landed.
        TransferFailed / TransferTimeout naming ``what``; after a failure it still waits
        (until the deadline) for the runs already in flight, so none lands later."""
        runs = coalesce_runs(src, dst, lengths)
        if not runs:
            return
        total = sum(n for _, _, n in runs)
        deadline = time.monotonic() + timeout_s
        pending: list[int] = []
        error: str | None = None
        for s, d, n in runs:  # one batch a run: its status is its only task's (module doc)
            batch = self._te.batch_transfer_async_write(session, [s], [d], [n])
            if not batch or batch < 0:
                error = (f"Mooncake write of {n} bytes to {session} could not be submitted (returned {batch}: the "
                         "receiver's transfer session is unreachable?)")
                break
            pending.append(batch)
        while pending:
            still = []
            for batch in pending:
                status = self._te.transfer_check_status(batch)
                if status == 0:
                    still.append(batch)
                elif status < 0 and error is None:
                    why = "timed out in the transfer engine" if status == -2 else "failed"
                    error = f"Mooncake write to {session} {why} (status {status})"
            pending = still
            if pending and time.monotonic() > deadline:
                raise TransferTimeout(f"{what}: Mooncake write of {total} bytes in {len(runs)} runs to {session} did "
                                      f"not finish within {timeout_s:g}s" + (f" ({error})" if error else ""))
            if pending:
                time.sleep(POLL_S)
        if error is not None:
            raise TransferFailed(f"{what}: {error} ({total} bytes in {len(runs)} runs)")


def coalesce_runs(src: list[int], dst: list[int], lengths: list[int]) -> list[tuple[int, int, int]]:
    """``(src, dst, length)`` runs with each run that continues the previous one on both
    sides merged into it (a rank's contiguous layers are one run)."""
    out: list[tuple[int, int, int]] = []
    for s, d, n in zip(src, dst, lengths):
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, d, n))
    return out
