"""The decode side of the Mooncake transport: :class:`KVReceiver`.

It runs a transfer engine, registers one buffer (the arena) and serves the control
channel (graphcp.pd.control) on a TCP port: each prefill rank connects, reads the
``hello`` (session, buffer, wanted layout), and per request sends ``open``; the first
``open`` of a request reserves its region (``meta.nbytes``, in the layout of the
request's format: graphcp-kv/1, or a family's own, graphcp.pd.formats; then its token
ids and first-token logits, graphcp.pd.riders) and
every sender of it gets the same address; each rank writes its part straight into
the arena and says ``done``. When every rank is done and the bytes add up, the
request is complete: every sender gets ``ack`` and :meth:`KVReceiver.get` hands it
out (a copy; its region is freed), or :meth:`KVReceiver.hold` lends it in place (views
of the arena, the region kept until :meth:`HeldKV.release`). With ``shared=True`` the
arena is a file in ``/dev/shm`` that the decode engine's ranks (other processes) map:
:meth:`HeldKV.ref` names the region, :meth:`RegionRef.open` gives a rank the export as
views of it, and ``engine.import_kv`` reads each rank's share straight from the bytes
Mooncake wrote (docs/pd.md, "Mooncake into the import"). A request that a sender aborts, whose sender's
connection closes first, or that is not complete within ``timeout_s`` fails: its
senders get ``failed``, ``get`` raises, nothing of it is handed out, and its region
is reused only once each of its senders has reported or disconnected (a slow
write can still land in it until then).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from graphcp.pd.control import Channel
from graphcp.pd.errors import SenderDied, TransferError, TransferFailed, TransferTimeout
from graphcp.pd.export import KVFormatError
from graphcp.pd.formats import Export, meta_from_dict, registered
from graphcp.pd.layout import TensorLayout
from graphcp.pd.mooncake import MooncakeEngine
from graphcp.pd.riders import Riders

ALIGN = 64


@dataclass
class _Request:
    meta: TensorLayout  # the request's format's
    riders: Riders  # the token ids and logits after its KV
    offset: int  # in the arena
    senders: int
    opened: float
    channels: set = field(default_factory=set)  # the Channels that opened it
    done: dict = field(default_factory=dict)  # rank -> bytes written
    settled: set = field(default_factory=set)  # channels that reported (done / abort) or closed
    error: str | None = None
    error_type: type = TransferFailed
    complete: bool = False

    @property
    def nbytes(self) -> int:
        """Its region: the KV and what rides after it."""
        return self.riders.region_bytes(self.meta.nbytes)


class _Arena:
    """First-fit allocator over ``[0, size)``, ALIGN-byte aligned."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free = [(0, size)]  # sorted, coalesced (start, end)

    def take(self, n: int) -> int | None:
        n = -(-n // ALIGN) * ALIGN
        for i, (s, e) in enumerate(self.free):
            if e - s >= n:
                self.free[i:i + 1] = [(s + n, e)] if e - s > n else []
                return s
        return None

    def give(self, start: int, n: int) -> None:
        n = -(-n // ALIGN) * ALIGN
        free = sorted(self.free + [(start, start + n)])
        merged = [free[0]]
        for s, e in free[1:]:
            if s == merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((s, e))
        self.free = merged

    @property
    def free_bytes(self) -> int:
        return sum(e - s for s, e in self.free)


def shared_path() -> str:
    """A new name for a shared arena's file (memory, not disk: ``/dev/shm``)."""
    return f"/dev/shm/graphcp-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class RegionRef:
    """A held request's region in a shared arena, as another process opens it (picklable):
    the arena's file, the region's byte offset, the request's metadata and what rides
    after its KV (graphcp.pd.riders)."""

    path: str
    offset: int
    meta: dict
    riders: dict = field(default_factory=dict)

    def open(self) -> Export:
        """The request as views of the mapped arena, its token ids and first-token logits
        too (no copy: a tensor whose offset is not a
        multiple of its item size, after tensors of a smaller dtype, is the exception). The
        views stay valid while this process holds them, after the region is released
        (the receiver may then reuse it: import before releasing)."""
        source = f"the held region of {self.path}"
        m = meta_from_dict(self.meta, source=source)
        riders = Riders.from_dict(self.riders, m.num_tokens, source)
        n = riders.region_bytes(m.nbytes)
        arena = torch.from_file(self.path, shared=True, size=self.offset + n, dtype=torch.uint8)
        return _export(m, riders, arena[self.offset:self.offset + n])


def _export(m: TensorLayout, riders: Riders, region: torch.Tensor) -> Export:
    """The request in ``region`` (its whole region) as views of it."""
    ids, logits = riders.views(region, m.nbytes)
    return m.make_export(m.unflatten(region[:m.nbytes]), token_ids=ids, last_logits=logits)


@dataclass
class HeldKV:
    """A complete request lent in place by :meth:`KVReceiver.hold`: ``export`` is views of
    the arena; its region is the receiver's again once :meth:`release` is called (a
    context manager releases on exit)."""

    export: Export
    #: the region as another process opens it (None unless the arena is shared)
    ref: RegionRef | None
    _release: object

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None

    def __enter__(self) -> "HeldKV":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class KVReceiver:
    """Receives requests' KV from the prefill ranks (module docstring).

    ``capacity_bytes``: the arena (the most KV in flight or waiting for :meth:`get`);
    ``fingerprint`` / ``dtype``: the model and dtype this decode side wants (None: any);
    ``timeout_s``: how long an opened request may take to complete; ``shared``: the
    arena in a file other processes map (:class:`RegionRef`): True for a new name under
    ``/dev/shm``, or the file's path (a caller that removes it if this process dies)."""

    def __init__(self, capacity_bytes: int, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 fingerprint: str | None = None, dtype: str | None = None, protocol: str = "tcp",
                 device_name: str = "", shared: bool | str = False) -> None:
        self.timeout_s = timeout_s
        self.want = {"fingerprint": fingerprint, "dtype": dtype}
        self.engine = MooncakeEngine(host, protocol, device_name)
        self.path = shared if isinstance(shared, str) else shared_path() if shared else None
        self.buffer = (torch.from_file(self.path, shared=True, size=capacity_bytes, dtype=torch.uint8) if shared
                       else torch.zeros(capacity_bytes, dtype=torch.uint8))
        self.base = self.engine.register(self.buffer)
        self._arena = _Arena(capacity_bytes)
        self._requests: dict[str, _Request] = {}
        self._cond = threading.Condition()
        self._server = socket.create_server((host, port))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, name="kv-receiver-accept", daemon=True).start()
        threading.Thread(target=self._watchdog, name="kv-receiver-watchdog", daemon=True).start()

    # ---- the decode side's API ----------------------------------------------------
    def get(self, request_id: str, timeout_s: float | None = None) -> Export:
        """The request once complete (a copy; its region is freed). Raises the request's
        error (SenderDied, TransferFailed, TransferTimeout) if it failed, and
        TransferTimeout if it is not complete within ``timeout_s`` (default: the
        receiver's)."""
        with self.hold(request_id, timeout_s) as held:
            e = held.export
            m = e.meta
            layers: list[dict[str, torch.Tensor]] = [{} for _ in range(m.num_layers)]
            for i, n in m.tensors():
                layers[i][n] = e.tensor(i, n).clone()
            return m.make_export(layers, token_ids=None if e.token_ids is None else e.token_ids.clone(),
                                 last_logits=None if e.last_logits is None else e.last_logits.clone())

    def hold(self, request_id: str, timeout_s: float | None = None) -> HeldKV:
        """The request once complete, lent in place: views of the arena (no copy), its region
        kept until :meth:`HeldKV.release` (then reused). Errors as :meth:`get`."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                req = self._requests.get(request_id)
                if req is not None and req.error is not None:
                    if req.offset < 0:  # its region is back: nothing of it is left but the error
                        del self._requests[request_id]
                    raise req.error_type(f"request {request_id!r}: {req.error}")
                if req is not None and req.complete:
                    del self._requests[request_id]
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    state = "never opened" if req is None else f"{len(req.done)} of {req.senders} parts arrived"
                    raise TransferTimeout(f"request {request_id!r} not complete within {wait:g}s ({state})")
                self._cond.wait(left)
        m = req.meta
        export = _export(m, req.riders, self.buffer[req.offset:req.offset + req.nbytes])
        ref = None if self.path is None else RegionRef(self.path, req.offset, m.to_dict(), req.riders.to_dict())

        def release() -> None:
            with self._cond:
                self._arena.give(req.offset, req.nbytes)
                self._cond.notify_all()

        return HeldKV(export, ref, release)

    def completed(self) -> list[str]:
        """Ids of the requests ready for :meth:`get`."""
        with self._cond:
            return [rid for rid, r in self._requests.items() if r.complete]

    @property
    def free_bytes(self) -> int:
        with self._cond:
            return self._arena.free_bytes

    def close(self) -> None:
        """Stop accepting; a shared arena's file is removed (a process that mapped it keeps
        its mapping)."""
        self._closed = True
        try:
            self._server.close()
        except OSError:
            pass
        if self.path is not None and os.path.exists(self.path):
            os.unlink(self.path)

    # ---- serving -----------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._server.accept()
            except OSError:
                return
            ch = Channel(sock, f"{peer[0]}:{peer[1]}")
            threading.Thread(target=self._serve, args=(ch,), name="kv-receiver-conn", daemon=True).start()

    def _serve(self, ch: Channel) -> None:
        try:
            ch.send(op="hello", session=self.engine.session, buffer=self.base, size=self.buffer.numel(),
                    format=registered(), **self.want)  # (the formats registered by now)
            while True:
                msg = ch.recv(None)
                if msg is None:
                    break
                self._handle(ch, msg)
        except TransferError:
            pass
        finally:
            self._disconnected(ch)
            ch.close()

    def _handle(self, ch: Channel, msg: dict) -> None:
        op, rid = msg.get("op"), str(msg.get("id"))
        if op == "open":
            reply = self._open(ch, rid, msg)
            ch.send(id=rid, **reply)
            return
        with self._cond:
            req = self._requests.get(rid)
            if req is None or ch not in req.channels:
                return
            req.settled.add(ch)
            if op == "done":
                req.done[int(msg.get("rank", -1))] = int(msg.get("bytes", 0))
                if req.error is None and len(req.done) == req.senders:
                    got = sum(req.done.values())
                    if got == req.meta.nbytes + req.riders.nbytes:  # (the padding between is not written)
                        req.complete = True
                        self._notify(req, rid, op="ack")
                    else:
                        self._fail(rid, req, f"the senders wrote {got} bytes, the request has {req.meta.nbytes} of "
                                             f"KV and {req.riders.nbytes} of token ids and logits")
            elif op == "abort":
                self._fail(rid, req, f"rank {msg.get('rank')} aborted: {msg.get('error')}")
            self._maybe_free(rid, req)
            self._cond.notify_all()

    def _open(self, ch: Channel, rid: str, msg: dict) -> dict:
        try:
            meta = meta_from_dict(msg.get("meta"), source=f"request {rid!r}")
            riders = Riders.from_dict(msg.get("riders"), meta.num_tokens, f"request {rid!r}")
        except KVFormatError as e:
            return {"op": "refused", "error": str(e)}
        for key in ("fingerprint", "dtype"):
            want = self.want[key]
            if want is not None and getattr(meta, key) != want:
                return {"op": "refused", "error": f"this receiver wants {key} {want!r}, the request has "
                                                  f"{getattr(meta, key)!r}"}
        with self._cond:
            req = self._requests.get(rid)
            if req is None:
                nbytes = riders.region_bytes(meta.nbytes)
                offset = self._arena.take(nbytes)
                if offset is None:
                    return {"op": "refused", "error": f"receiver buffer full: the request needs {nbytes} bytes, "
                                                      f"{self._arena.free_bytes} of {self._arena.size} are free"}
                req = self._requests[rid] = _Request(meta, riders, offset, int(msg.get("senders", 1)),
                                                     time.monotonic())
            elif req.meta != meta or req.riders != riders or req.error is not None or req.complete:
                why = req.error or ("already complete" if req.complete else "opened with other metadata")
                return {"op": "refused", "error": f"request {rid!r}: {why}"}
            req.channels.add(ch)
            return {"op": "region", "addr": self.base + req.offset}

    def _disconnected(self, ch: Channel) -> None:
        with self._cond:
            for rid, req in list(self._requests.items()):
                if ch in req.channels and ch not in req.settled:
                    req.settled.add(ch)
                    if not req.complete:
                        self._fail(rid, req, f"a sender's connection ({ch.peer}) closed before it finished its part "
                                             "(the sender died?)", SenderDied)
                    self._maybe_free(rid, req)
            self._cond.notify_all()

    def _watchdog(self) -> None:
        while not self._closed:
            time.sleep(min(0.2, self.timeout_s / 4))
            now = time.monotonic()
            with self._cond:
                for rid, req in list(self._requests.items()):
                    if not req.complete and req.error is None and now - req.opened > self.timeout_s:
                        self._fail(rid, req, f"not complete within {self.timeout_s:g}s ({len(req.done)} of "
                                             f"{req.senders} parts arrived)", TransferTimeout)
                    self._maybe_free(rid, req)
                self._cond.notify_all()

    def _fail(self, rid: str, req: _Request, error: str, error_type: type = TransferFailed) -> None:
        """Under the lock: mark a request failed (the first reason stays) and tell its senders."""
        if req.error is None and not req.complete:
            req.error, req.error_type = error, error_type
            self._notify(req, rid, op="failed", error=error)

    def _notify(self, req: _Request, rid: str, **msg) -> None:
        for c in req.channels:  # every sender of it (a closed one just fails to hear it)
            try:
                c.send(id=rid, **msg)
            except TransferError:
                pass

    def _maybe_free(self, rid: str, req: _Request) -> None:
        """A failed request's region is reused once every sender of it has settled; the
        request stays listed (its error is what ``get`` raises)."""
        if req.error is not None and req.offset >= 0 and req.settled >= req.channels:
            self._arena.give(req.offset, req.nbytes)
            req.offset = -1
