"""Where the worker sends a request's KV: its decode side's address, through one transport.

- ``file``: the address is a folder the decode side reads; the request's KV is
  ``DIR/<id>.safetensors`` (graphcp.pd.files: written to a temporary name and renamed,
  with its tokens and first-token logits), written by the run's rank 0 once every rank's
  part is assembled (``engine.export_kv(handle, dst=0)``).
- ``mooncake``: the address is a :class:`graphcp.pd.receiver.KVReceiver`'s ``host:port``;
  every rank writes its own spans into the receiver's memory, rank 0 the request's
  tokens and first-token logits after them (graphcp.pd.sender: one
  ``KVSender`` a rank and decode side, kept while the side answers, over the rank's one
  transfer engine).

:meth:`probe` (rank 0, before a request is queued) says why an address cannot be
reached; :meth:`deliver` (every rank, the same requests in the same order) sends one
request and returns the bytes of its KV, raising what the transport raised.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError

from graphcp.errors import one_line
from graphcp.pd.control import Channel, connect
from graphcp.pd.errors import ReceiverDied, ReceiverUnreachable, TransferError, TransferFailed
from graphcp.pd.files import save_kv
from graphcp.pd.mooncake import MooncakeEngine
from graphcp.pd.sender import KVSender
from graphcp.runtime.engine import PrefillEngine

#: seconds a probe of a Mooncake receiver waits for its connection and hello
PROBE_TIMEOUT_S = 2.0
TRANSPORTS = ("file", "mooncake")


class Transport(Protocol):
    name: str

    def probe(self, address: str) -> str | None: ...

    def deliver(self, engine: PrefillEngine, handle, request_id: str, address: str, tokens: torch.Tensor,
                last_logits: torch.Tensor) -> int: ...

    def close(self) -> None: ...


class FileTransport:
    """The decode side is a folder (module doc)."""

    name = "file"

    def probe(self, address: str) -> str | None:
        d = Path(address)
        if not d.is_absolute():
            return f"decode side {address!r}: the file transport takes an absolute folder path"
        if not d.is_dir():
            return f"decode side {address}: no such folder (the decode side is gone, or the path is wrong)"
        if not os.access(d, os.W_OK | os.X_OK):
            return f"decode side {address}: the folder is not writable by this worker"
        return None

    def deliver(self, engine: PrefillEngine, handle, request_id: str, address: str, tokens: torch.Tensor,
                last_logits: torch.Tensor) -> int:
        export = engine.export_kv(handle, dst=0)  # every rank takes part; rank 0 gets it
        if export is None:
            return 0
        export.token_ids, export.last_logits = tokens, last_logits
        path = Path(address) / f"{request_id}.safetensors"
        try:
            save_kv(export, path)
        except (OSError, SafetensorError) as e:  # (safetensors words an I/O error its own way)
            raise TransferFailed(f"decode side {address}: cannot write {path.name} ({one_line(e)}): the decode side "
                                 "is gone?") from None
        return export.meta.nbytes

    def close(self) -> None:
        pass


class MooncakeTransport:
    """The decode side is a Mooncake receiver (module doc). ``timeout_s`` bounds each
    connection, write and acknowledgement."""

    name = "mooncake"

    def __init__(self, rank: int, world_size: int, host: str, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.engine = MooncakeEngine(host)  # this rank's one transfer engine, whichever sides it sends to
        self._senders: dict[str, KVSender] = {}

    def probe(self, address: str) -> str | None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            return f"decode side {address!r}: the mooncake transport takes a receiver's host:port"
        try:
            sock = connect(address, PROBE_TIMEOUT_S)
        except OSError as e:
            return f"decode side {address}: unreachable ({type(e).__name__}: {e})"
        ch = Channel(sock, address)
        try:
            hello = ch.recv(PROBE_TIMEOUT_S)
        except TransferError as e:
            return f"decode side {address}: no KV receiver's hello ({e})"
        finally:
            ch.close()
        if hello is None or hello.get("op") != "hello":
            return f"decode side {address}: not a graphcp KV receiver (no hello)"
        return None

    def deliver(self, engine: PrefillEngine, handle, request_id: str, address: str, tokens: torch.Tensor,
                last_logits: torch.Tensor) -> int:
        sender = self._senders.get(address)
        if sender is None:
            sender = self._senders[address] = KVSender(address, self.rank, self.world_size, timeout_s=self.timeout_s,
                                                       transfer_engine=self.engine)
        try:
            sender.send(engine, [handle], [request_id], [tokens], [last_logits])  # the ids and logits ride along
        except (ReceiverDied, ReceiverUnreachable):
            self._drop(address)  # the decode side is gone: a later request connects again
            raise
        return engine.kv_meta(handle).nbytes if self.rank == 0 else 0

    def _drop(self, address: str) -> None:
        sender = self._senders.pop(address, None)
        if sender is not None:
            try:
                sender.close()
            except (OSError, TransferError):
                pass

    def close(self) -> None:
        for address in list(self._senders):
            self._drop(address)


def make_transport(name: str, engine: PrefillEngine, host: str, timeout_s: float) -> Transport:
    if name == "file":
        return FileTransport()
    if name == "mooncake":
        return MooncakeTransport(engine.world_rank, engine.world.size, host, timeout_s)
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {name!r}")


def local_host(listen_host: str) -> str:
    """The host this worker's Mooncake engine names itself by: loopback when it listens
    there, else this machine's name as the network sees it."""
    if listen_host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname()) if listen_host in ("", "0.0.0.0", "::") else listen_host
