"""The KV transport's control channel: one JSON object a line over a TCP connection
(the bootstrap and the per-request handshake of graphcp.pd.sender / receiver; the
bulk data never goes through it).

Messages (``op``; every request message carries its ``id``):

- receiver -> sender on connect: ``hello`` with the transfer session, the registered
  buffer (``buffer``, ``size``) and what it takes (``format``: the export formats it
  reads, graphcp.pd.formats; optionally ``fingerprint`` and ``dtype``);
- sender -> receiver: ``open`` (``rank``, ``senders``: how many ranks write parts,
  ``meta``: the request's metadata, in its format; ``riders``: how many token ids and
  logits follow its KV in the region, graphcp.pd.riders), then ``done`` (``rank``, ``bytes`` written) or
  ``abort`` (``rank``, ``error``);
- receiver -> sender: ``region`` (``addr``: where the request goes) or ``refused``
  (``error``), and when the request is settled ``ack`` (every part arrived) or
  ``failed`` (``error``) to every sender of it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

from graphcp.pd.errors import ReceiverDied, TransferTimeout

MAX_LINE = 1 << 20  # a control message is small; a longer line is a broken peer


class Channel:
    """A connected socket speaking JSON lines, with a deadline on every read."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self._buf = b""
        self._parked: list[dict] = []  # messages read while waiting for another
        self._send_lock = threading.Lock()  # a receiver's threads may tell one sender things at once

    def send(self, **msg: Any) -> None:
        try:
            with self._send_lock:
                self.sock.sendall((json.dumps(msg) + "\n").encode())
        except OSError as e:
            raise ReceiverDied(f"control connection to {self.peer} broke while sending {msg.get('op')!r}: "
                               f"{type(e).__name__}: {e}") from None

    def recv(self, timeout_s: float | None) -> dict | None:
        """The next message, or None when the peer closed the connection; TransferTimeout
        after ``timeout_s`` (None: wait for ever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_LINE:
                raise ReceiverDied(f"{self.peer} sent a control line over {MAX_LINE} bytes")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TransferTimeout(f"no message from {self.peer} within {timeout_s:g}s")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return None
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReceiverDied(f"{self.peer} sent a malformed control message ({e})") from None
        return msg if isinstance(msg, dict) else {"op": "malformed"}

    def wait_for(self, request_id: str, ops: tuple[str, ...], timeout_s: float) -> dict | None:
        """The next message about ``request_id`` with an op in ``ops`` (others are kept
        for a later wait); None when the peer closed the connection."""
        for i, m in enumerate(self._parked):
            if m.get("id") == request_id and m.get("op") in ops:
                return self._parked.pop(i)
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            if msg is None:
                return None
            if msg.get("id") == request_id and msg.get("op") in ops:
                return msg
            self._parked.append(msg)

    def peer_closed(self) -> bool:
        """Whether the peer has closed the connection (checked without blocking)."""
        try:
            self.sock.settimeout(0.0)
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def connect(address: str, timeout_s: float) -> socket.socket:
    """A TCP connection to ``host:port`` (OSError when it cannot be made in time)."""
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=timeout_s)
