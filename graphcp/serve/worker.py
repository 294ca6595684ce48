"""The worker's loop, on every rank (SPMD): rank 0 takes the next command from its
socket (graphcp.serve.frontend) and broadcasts it over the run's host group; every rank
then prefills the batch, sends each request's KV to its decode side
(graphcp.serve.transports) and releases it; rank 0 replies one line a request.

It stops when ``stop`` is set (SIGTERM to the command, or to rank 0): the batch in hand is
finished, what is queued is refused, every rank returns, and rank 0 reports the pool's
free pages on every rank before and after (equal: no page leaked).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphcp.dist import CPGroup, broadcast_object, gather_object, host_group
from graphcp.errors import BatchError, one_line
from graphcp.jobs.spec import JobSpec, make_engine
from graphcp.kv.handle import KVCacheFull
from graphcp.pd.errors import TransferError
from graphcp.runtime.batch import Request
from graphcp.runtime.engine import PrefillEngine
from graphcp.serve.batcher import Batcher
from graphcp.serve.frontend import Frontend
from graphcp.serve.protocol import PREFILL, TRANSFER, ServeRequest, encode, error_reply
from graphcp.serve.transports import local_host, make_transport

#: seconds between idle beats (well under any collective timeout)
BEAT_S = 1.0
#: the warm-up request's tokens
WARM_TOKENS = 16


@dataclass(frozen=True)
class ServeOptions:
    transport: str
    host: str
    port: int
    batch_wait_s: float
    transfer_timeout_s: float


def serve_job(group: CPGroup, spec: JobSpec, opts: ServeOptions, stop: Any) -> dict | None:
    """Every rank: the worker until ``stop`` (a multiprocessing Event) is set; rank 0
    returns the exit report."""
    engine = make_engine(group, spec)
    ctl = host_group(engine.world)
    first = engine.world_rank == 0
    _on_sigterm(stop, first)
    if engine.parts.runner is not None:
        engine.capture()  # every bucket before the first request (a capture is not a request's wait)
    for h in engine.prefill([Request(np.zeros(WARM_TOKENS, dtype=np.int64))]).handles:
        engine.release(h)  # the first forward's one-time costs (compiled host kernels), before any request
    batcher = Batcher.of(engine)
    transport = make_transport(opts.transport, engine, local_host(opts.host), opts.transfer_timeout_s)
    before = gather_object(ctl, engine.parts.kv.num_free_pages)
    front = None
    if first:
        limits = batcher.limits(engine.cfg.vocab_size, engine.max_context)
        front = Frontend(opts.host, opts.port, limits, transport.probe)
        _say({"event": "listening", "address": front.address, "transport": transport.name,
              "max_tokens": limits.max_tokens, "free_pages": before})
    why = "the worker stopped (SIGTERM) before prefilling it"
    try:
        while True:
            cmd = front.next_command(stop.is_set, batcher, opts.batch_wait_s, BEAT_S) if first else None
            cmd = broadcast_object(ctl, cmd)
            if cmd.op == "stop":
                break
            if cmd.op == "status":
                pages = gather_object(ctl, engine.parts.kv.num_free_pages)
                if first:
                    front.reply_status({"free_pages": pages, "start_free_pages": before})
            elif cmd.op == "batch":
                replies = run_batch(engine, ctl, transport, cmd.requests)
                if first:
                    for req, reply in zip(cmd.requests, replies):
                        front.reply(req.id, reply)
    except KeyboardInterrupt:
        why = "the worker was interrupted (Ctrl-C)"
        raise
    except BaseException as e:
        why = f"the worker failed: {one_line(e)}"
        raise
    finally:
        if front is not None:
            front.close(why)  # every request still held gets its one line
        transport.close()
    after = gather_object(ctl, engine.parts.kv.num_free_pages)
    if not first:
        return None
    return {"event": "stopped", **front.counts, "free_pages": after, "start_free_pages": before,
            "leaked_pages": sum(before) - sum(after)}


def run_batch(engine: PrefillEngine, ctl: CPGroup, transport, reqs: list[ServeRequest]) -> list[dict]:
    """Every rank: prefill ``reqs``, send each request's KV, release it (a part at a time:
    :func:`prefill_parts`). Each request's reply (rank 0's are the ones sent)."""
    started = time.monotonic()
    replies: list[dict] = [{} for _ in reqs]
    failed: dict[int, str] = {}  # this rank's transfer errors
    for idx, got, prefill_s in prefill_parts(engine, ctl, reqs, list(range(len(reqs)))):
        if isinstance(got, str):
            for j in idx:
                replies[j] = error_reply(reqs[j].id, PREFILL, got)
            continue
        for j, handle, logits in zip(idx, got.handles, got.last_logits.float()):
            t0 = time.monotonic()
            try:
                nbytes = transport.deliver(engine, handle, reqs[j].id, reqs[j].decode,
                                           torch.from_numpy(reqs[j].tokens), logits)
            except (TransferError, OSError) as e:  # the decode side's (gone, full, refusing): the worker goes on
                failed[j], nbytes = one_line(e), 0
            finally:
                engine.release(handle)
            replies[j] = {"id": reqs[j].id, "ok": True, "tokens": int(reqs[j].tokens.shape[0]),
                          "next_token": int(logits.argmax()), "bytes": nbytes, "batch": len(idx),
                          "queue_ms": _ms(started - reqs[j].arrived), "prefill_ms": _ms(prefill_s),
                          "transfer_ms": _ms(time.monotonic() - t0)}
    for rank_failed in gather_object(ctl, failed):  # a request is sent once every rank sent its part
        for j, error in rank_failed.items():
            if replies[j].get("ok"):
                replies[j] = error_reply(reqs[j].id, TRANSFER, error)
    return replies


def prefill_parts(engine: PrefillEngine, ctl: CPGroup, reqs: list[ServeRequest], idx: list[int]) -> Iterator[tuple]:
    """Prefill requests ``idx`` of ``reqs`` in one forward: ``(idx, PrefillOutput, seconds)``,
    or ``(idx, error, 0)``. A batch the pool cannot hold (KVCacheFull on some rank: under
    attention DP the other replicas' ranks see "another replica refused", so the ranks
    agree on it; nothing reserved) is prefilled in halves, each yielded (and released by
    the caller) before the next; a request refused alone gets the error."""
    t0 = time.monotonic()
    try:
        out = engine.prefill([Request(reqs[j].tokens) for j in idx])
    except BatchError as e:  # (raised on every rank, nothing changed)
        seen = gather_object(ctl, (isinstance(e, KVCacheFull), one_line(e)))
        full = [message for is_full, message in seen if is_full]
        if full and len(idx) > 1:
            half = len(idx) // 2
            yield from prefill_parts(engine, ctl, reqs, idx[:half])
            yield from prefill_parts(engine, ctl, reqs, idx[half:])
            return
        out = full[0] if full else seen[0][1]
    yield idx, out, time.monotonic() - t0


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _say(line: dict) -> None:
    """A line of the worker's own on stdout (the address it listens on)."""
    sys.stdout.buffer.write(encode(line))
    sys.stdout.flush()


def _on_sigterm(stop: Any, first: bool) -> None:
    """SIGTERM to rank 0 (a signal to the whole process group) stops the worker as one to
    the command does; the other ranks leave it to rank 0's command."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, (lambda sig, frame: stop.set()) if first else signal.SIG_IGN)
