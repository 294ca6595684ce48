"""The Mooncake transfer engine, as the KV transport uses it.

``mooncake-transfer-engine`` (``pip install -e ".[pd]"``; on CPU machines the
``-non-cuda`` wheel, which links the system's ``libibverbs1``). Each side runs one
engine with the P2P handshake (no metadata server: a peer is named by its session,
``host:rpc_port``), ``tcp`` on one machine or ``rdma`` where the cluster has it.
A receiver registers one buffer; a sender registers its staging buffer and writes
into the receiver's buffer with batched one-sided writes, polled against a deadline
(``batch_transfer_async_write`` + ``transfer_check_status``: 1 done, 0 running,
-1 failed, -2 timed out).
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
        ``session``'s registered memory; TransferFailed / TransferTimeout naming ``what``."""
        if not src:
            return
        total = sum(lengths)
        batch = self._te.batch_transfer_async_write(session, src, dst, lengths)
        if not batch or batch < 0:
            raise TransferFailed(f"{what}: Mooncake could not submit {len(src)} writes ({total} bytes) to {session} "
                                 f"(returned {batch}: the receiver's transfer session is unreachable?)")
        deadline = time.monotonic() + timeout_s
        while True:
            status = self._te.transfer_check_status(batch)
            if status == 1:
                return
            if status < 0:
                why = "timed out in the transfer engine" if status == -2 else "failed"
                raise TransferFailed(f"{what}: Mooncake write of {total} bytes in {len(src)} runs to {session} {why} "
                                     f"(status {status})")
            if time.monotonic() > deadline:
                raise TransferTimeout(f"{what}: Mooncake write of {total} bytes to {session} did not finish within "
                                      f"{timeout_s:g}s")
            time.sleep(POLL_S)
