"""Rank 0's side of the worker's socket.

A thread accepts clients and reads their lines: each line is admitted (queued, with its
arrival time) or refused with one line at once, while the ranks work on an earlier batch;
nothing of the engine is touched there, so a refusal reserves no page. The ranks' loop
(graphcp.serve.worker, rank 0's main thread) takes a :class:`Command` at a time
(:meth:`Frontend.next_command`): a batch once it is full or its first request has waited
``batch_wait_s``, a status, an idle beat (so the other ranks' wait for the next command
never reaches the collective timeout), or stop; and replies per request when the batch
is done. :meth:`Frontend.close` refuses what is still queued, so every admitted request
gets exactly one reply.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from graphcp.serve.batcher import Batcher
from graphcp.serve.protocol import (
    MAX_LINE,
    REFUSED,
    STOPPED,
    Limits,
    RequestError,
    ServeRequest,
    encode,
    error_reply,
    parse_line,
    parse_request,
)

#: seconds a reply may take to leave (a client that reads none is dropped)
SEND_TIMEOUT_S = 10.0
#: requests queued at most; more are refused (the clients send faster than the ranks prefill)
MAX_QUEUED = 4096
#: how often the main thread looks at the stop event while it waits
POLL_S = 0.05


@dataclass
class Command:
    """What every rank does next: ``batch`` (its ``requests``), ``status``, ``idle``, ``stop``."""

    op: str
    requests: list[ServeRequest] = field(default_factory=list)


class Client:
    """One connection: its unread bytes, and its replies (from either thread) one at a time."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self.buf = b""
        self.skipping = False  # inside a line over MAX_LINE: dropped up to its end
        self.lock = threading.Lock()
        self.open = True

    def send(self, reply: dict) -> None:
        """One reply line; a client that went away or reads nothing is dropped (the
        worker goes on: its requests still run)."""
        with self.lock:
            if not self.open:
                return
            try:
                self.sock.sendall(encode(reply))
            except OSError:
                self.close()

    def close(self) -> None:
        self.open = False
        try:
            self.sock.close()
        except OSError:
            pass


class Frontend:
    """The socket at ``host:port`` (port 0: one the OS picks; :attr:`address` says which),
    its reader thread, the queue and the replies (module doc). ``probe(address)`` says why
    a decode side cannot be reached (None: it can)."""

    def __init__(self, host: str, port: int, limits: Limits, probe: Callable[[str], str | None]) -> None:
        self.limits, self.probe = limits, probe
        self.server = listen(host, port)
        self.address = f"{f'[{host}]' if ':' in host else host}:{self.server.getsockname()[1]}"
        self._cond = threading.Condition()
        self._queue: deque[ServeRequest] = deque()
        self._held: dict[str, Client] = {}  # every admitted request not yet replied to
        self._status: list[Client] = []
        self._clients: set[Client] = set()
        self._closing = False
        self.counts = {"served": 0, "failed": 0, "refused": 0}
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.server, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._read_loop, name="serve-prefill-reader", daemon=True)
        self._thread.start()

    # ---- the reader thread ------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            for key, _ in self._sel.select(timeout=1.0):
                if key.data == "wake":
                    return
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)

    def _accept(self) -> None:
        try:
            sock, peer = self.server.accept()
        except OSError:
            return
        sock.settimeout(SEND_TIMEOUT_S)  # (reads happen only when select says there are bytes)
        client = Client(sock, f"{peer[0]}:{peer[1]}")
        with self._cond:
            self._clients.add(client)
        self._sel.register(sock, selectors.EVENT_READ, client)

    def _read(self, client: Client) -> None:
        try:
            chunk = client.sock.recv(1 << 16)
        except OSError:
            chunk = b""
        if not chunk:  # the client closed: its queued requests still run, their replies go nowhere
            self._forget(client)
            return
        client.buf += chunk
        while True:
            line, sep, rest = client.buf.partition(b"\n")
            if not sep:
                if len(client.buf) > MAX_LINE and not client.skipping:
                    client.send(error_reply(None, REFUSED, f"a line over {MAX_LINE} bytes (skipped to its end)"))
                    self._count("refused")
                    client.skipping = True
                if client.skipping:
                    client.buf = b""
                return
            client.buf = rest
            if client.skipping:
                client.skipping = False
            elif line.strip():
                self._admit(client, line)

    def _forget(self, client: Client) -> None:
        self._sel.unregister(client.sock)
        client.close()
        with self._cond:
            self._clients.discard(client)

    def _admit(self, client: Client, line: bytes) -> None:
        """Queue the line's request, or refuse it with one line (nothing reserved either way)."""
        rid = None
        try:
            obj = parse_line(line)
            if obj.get("op") == "status" and len(obj) == 1:
                with self._cond:
                    self._status.append(client)
                    self._cond.notify_all()
                return
            req = parse_request(obj, self.limits)
            rid = req.id
            why = self.probe(req.decode)
            if why is not None:
                raise RequestError(why, rid)
        except RequestError as e:
            client.send(error_reply(e.request_id, REFUSED, e))
            self._count("refused")
            return
        with self._cond:
            why = ("the worker is stopping" if self._closing else
                   f"request {rid!r} is already queued or running" if rid in self._held else
                   f"the queue is full ({MAX_QUEUED} requests)" if len(self._queue) >= MAX_QUEUED else None)
            if why is None:
                req.arrived = time.monotonic()
                self._queue.append(req)
                self._held[rid] = client
                self._cond.notify_all()
        if why is not None:
            client.send(error_reply(rid, STOPPED if self._closing else REFUSED, why))
            self._count("refused")

    def _count(self, what: str) -> None:
        with self._cond:
            self.counts[what] += 1

    # ---- the ranks' loop (rank 0's main thread) -------------------------------------------
    def next_command(self, stop: Callable[[], bool], batcher: Batcher, wait_s: float, beat_s: float) -> Command:
        """The next command: stop once ``stop()`` says so; a status asked for; a batch once
        the requests queued fill one or the oldest has waited ``wait_s``; idle after
        ``beat_s`` of nothing."""
        beat = time.monotonic() + beat_s
        with self._cond:
            while True:
                if stop():
                    return Command("stop")
                if self._status:
                    return Command("status")
                now = time.monotonic()
                if self._queue:
                    lengths = [r.tokens.shape[0] for r in self._queue]
                    n = batcher.fit(lengths)
                    if n < len(lengths) or n == batcher.max_requests or now >= self._queue[0].arrived + wait_s:
                        return Command("batch", [self._queue.popleft() for _ in range(n)])
                    until = min(self._queue[0].arrived + wait_s, beat)
                else:
                    until = beat
                if now >= beat:
                    return Command("idle")
                self._cond.wait(min(POLL_S, max(0.0, until - now)))

    def reply(self, request_id: str, reply: dict) -> None:
        """The one reply of an admitted request (``ok`` or its error)."""
        with self._cond:
            client = self._held.pop(request_id, None)
            self.counts["served" if reply.get("ok") else "failed"] += 1
        if client is not None:
            client.send(reply)

    def reply_status(self, status: dict) -> None:
        with self._cond:
            waiting, self._status = self._status, []
            status = {**status, "queued": len(self._queue), **self.counts}
        for client in waiting:
            client.send({"op": "status", **status})

    def close(self, why: str) -> None:
        """Refuse every request still queued or held (``why``), stop reading, close every
        connection (each reply sent before)."""
        with self._cond:
            self._closing = True
            left = list(self._held)
            self._queue.clear()
        for rid in left:
            self.reply(rid, error_reply(rid, STOPPED, why))
        self._wake_w.send(b"x")
        self._thread.join(timeout=5.0)
        with self._cond:
            clients = list(self._clients)
        for client in clients:
            client.close()
        for s in (self.server, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()


def listen(host: str, port: int) -> socket.socket:
    """A listening socket at ``host:port`` (an IPv6 host, such as ``::1``, too)."""
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
