"""The prefill side of the Mooncake transport: :class:`KVSender`, one per prefill rank
(``KVSender(address, engine.world_rank, engine.world.size)``: every rank of the run;
under pipeline stages each sends its stage's layers, under attention TP its KV heads).

Every rank of the prefill group calls :meth:`KVSender.send` with the same handles and
request ids (like ``prefill``), and sends only the spans its cache mode makes it the
owner of (graphcp.kv.spans: a contiguous range of layers for the replicated and the
layer-split caches), with no collective between the ranks: per request it ``open``s
the request on the control channel (the receiver answers with the request's region),
copies its spans into a registered staging buffer in the export layout (any format:
graphcp.pd.layout gives the runs), writes them
with Mooncake writes (one batch a contiguous run) straight into the receiver's memory and says
``done``; rank 0 also writes the request's token ids and first-token logits after the KV
(graphcp.pd.riders). ``send`` returns when the receiver acknowledged every request; until then,
and after any error, the request's KV is still in the engine (nothing is released:
``engine.release`` after ``send`` returned; a retry or an export to file still works).
"""

from __future__ import annotations

from typing import Sequence

import torch

from graphcp.errors import ConfigError
from graphcp.pd.control import Channel, connect
from graphcp.pd.errors import ReceiverDied, ReceiverUnreachable, TransferFailed, TransferTimeout
from graphcp.pd.mooncake import MooncakeEngine
from graphcp.pd.riders import Riders, as_ids


class KVSender:
    """One prefill rank's connection to a :class:`graphcp.pd.receiver.KVReceiver` at
    ``receiver`` (its control ``host:port``). ``timeout_s`` bounds the connection, each
    write and each acknowledgement. ``transfer_engine``: this process's Mooncake engine,
    shared by its senders to several receivers (None: one of its own, from ``host``,
    ``protocol``, ``device_name``)."""

    def __init__(self, receiver: str, rank: int = 0, cp_size: int = 1, host: str = "127.0.0.1",
                 timeout_s: float = 30.0, protocol: str = "tcp", device_name: str = "",
                 transfer_engine: MooncakeEngine | None = None) -> None:
        self.rank, self.cp_size, self.timeout_s = rank, cp_size, timeout_s
        self.engine = transfer_engine or MooncakeEngine(host, protocol, device_name)
        try:
            sock = connect(receiver, timeout_s)
        except (OSError, ValueError) as e:
            raise ReceiverUnreachable(f"rank {rank}: KV receiver {receiver} unreachable within {timeout_s:g}s "
                                      f"({type(e).__name__}: {e})") from None
        self.channel = Channel(sock, receiver)
        try:
            hello = self.channel.recv(timeout_s)
        except TransferTimeout:
            raise ReceiverUnreachable(f"rank {rank}: {receiver} accepted the connection but sent no hello within "
                                      f"{timeout_s:g}s (not a graphcp KV receiver?)") from None
        if hello is None or hello.get("op") != "hello":
            raise ReceiverDied(f"rank {rank}: {receiver} closed the connection instead of its hello")
        self.session = str(hello["session"])
        self.wants = hello
        self._staging: torch.Tensor | None = None
        self._staging_addr = 0

    def send(self, engine, handles: Sequence, request_ids: Sequence[str], token_ids: Sequence | None = None,
             last_logits: Sequence[torch.Tensor] | torch.Tensor | None = None) -> None:
        """Send each handle's KV as ``request_ids[i]``, with its prompt's ``token_ids[i]`` and
        first-token ``last_logits[i]`` (the prefill's, float32 [vocab]) when given: they ride
        after the KV in the region (graphcp.pd.riders), so the receiver's export carries them
        as a file's does. Every rank passes the same; rank 0 writes them. Returns once the
        receiver acknowledged every request (module docstring). Raises ReceiverDied,
        TransferFailed or TransferTimeout naming the request; releases nothing."""
        for what, given in (("request ids", request_ids), ("token_ids", token_ids), ("last_logits", last_logits)):
            if given is not None and len(given) != len(handles):
                raise ValueError(f"{len(handles)} handles but {len(given)} {what}")
        ids = [None] * len(handles) if token_ids is None else [as_ids(t) for t in token_ids]
        logits = [None] * len(handles) if last_logits is None else list(last_logits)
        if (self.rank, self.cp_size) != (engine.world_rank, engine.world.size):
            raise ConfigError(f"KVSender(rank={self.rank}, cp_size={self.cp_size}) sends for an engine that is rank "
                              f"{engine.world_rank} of {engine.world.size}: give each sender its engine's "
                              "world_rank and world.size (every rank of every pipeline stage sends its part)")
        for h in handles:
            local = _local(h)
            if local is not None:
                engine.parts.kv.check_handle(local)
        for h, rid, t, x in zip(handles, request_ids, ids, logits):
            self._send_one(engine, h, str(rid), t, x)
        for rid in request_ids:
            self._wait_ack(str(rid))

    def close(self) -> None:
        self.channel.close()
        if self._staging is not None:
            self.engine.unregister(self._staging_addr)
            self._staging = None

    # ---- steps -------------------------------------------------------------------------
    def _what(self, rid: str) -> str:
        return f"rank {self.rank}: request {rid!r}"

    def _reply(self, rid: str, ops: tuple[str, ...], waiting_for: str) -> dict:
        try:
            msg = self.channel.wait_for(rid, ops, self.timeout_s)
        except TransferTimeout:
            raise TransferTimeout(f"{self._what(rid)}: the receiver sent no {waiting_for} within "
                                  f"{self.timeout_s:g}s; the KV is still in the prefill engine") from None
        if msg is None:
            raise ReceiverDied(f"{self._what(rid)}: the receiver ({self.channel.peer}) closed the connection before "
                               f"its {waiting_for} (it died?); the KV is still in the prefill engine")
        if msg["op"] in ("refused", "failed"):
            raise TransferFailed(f"{self._what(rid)}: the receiver {msg['op']} it: {msg.get('error')}; the KV is "
                                 "still in the prefill engine")
        return msg

    def _send_one(self, engine, handle, rid: str, token_ids: torch.Tensor | None,
                  last_logits: torch.Tensor | None) -> None:
        meta = engine.kv_meta(handle)  # either format: the runs come from its layout (graphcp.pd.layout)
        riders = Riders.of(token_ids, last_logits)
        if riders.num_tokens not in (0, meta.num_tokens):
            raise ValueError(f"{self._what(rid)}: {riders.num_tokens} token ids for a request of {meta.num_tokens} "
                             "tokens")
        # the spans this rank owns in its CP group (under pipeline stages: of its stage's layers)
        source = engine.parts.kv_source  # the cache, or what reads a family's cache state
        shard = _shard(engine)
        local = _local(handle)  # (under attention DP: None on the ranks of the replicas that do not hold it)
        mine = [s for s in source.kv_spans(local, engine.parts.group.size) if s.owner == engine.rank] \
            if shard != (0, 0) and local is not None else []
        self.channel.send(op="open", id=rid, rank=self.rank, senders=self.cp_size, meta=meta.to_dict(),
                          riders=riders.to_dict())
        base = int(self._reply(rid, ("region", "refused", "failed"), "region")["addr"])
        extra = riders.pack(token_ids, last_logits) if self.rank == 0 else torch.empty(0, dtype=torch.uint8)
        staging = self._stage(extra.numel() + sum(meta.nbytes_of(s.layer, n, s.num_tokens) for s in mine
                                                  for n in meta.layer_tensors(s.layer)))
        src, dst, lengths = [], [], []
        pos = 0
        if extra.numel():  # the ids and logits, after the KV (rank 0's)
            staging[:extra.numel()].copy_(extra)
            src.append(self._staging_addr)
            dst.append(base + riders.offset(meta.nbytes))
            lengths.append(extra.numel())
            pos = extra.numel()
        for span in mine:
            for name, t in zip(meta.layer_tensors(span.layer), source.read_span(local, span)):
                dtype = meta.tensor_dtype(span.layer, name)  # bytes: a format may mix dtypes (float32 gates)
                nb = t.numel() * dtype.itemsize
                staging[pos:pos + nb].copy_(t.to(dtype).contiguous().view(-1).view(torch.uint8))
                runs = meta.span_runs(span.layer, name, span.start, span.num_tokens)
                if shard is not None:  # this attention-TP rank's rows of the tensor
                    runs = shard_runs(meta, span.layer, name, runs, *shard)
                for s_off, d_off, n in runs:
                    src.append(self._staging_addr + pos + s_off)
                    dst.append(base + d_off)
                    lengths.append(n)
                pos += nb
        try:
            self.engine.write(self.session, src, dst, lengths, self.timeout_s, self._what(rid))
        except (TransferFailed, TransferTimeout) as e:
            if self.channel.peer_closed():
                raise ReceiverDied(f"{self._what(rid)}: the receiver ({self.channel.peer}) died during the transfer "
                                   f"({e}); the KV is still in the prefill engine") from None
            try:
                self.channel.send(op="abort", id=rid, rank=self.rank, error=str(e))
            except ReceiverDied:
                pass
            raise type(e)(f"{e}; the KV is still in the prefill engine") from None
        self.channel.send(op="done", id=rid, rank=self.rank, bytes=sum(lengths))

    def _wait_ack(self, rid: str) -> None:
        self._reply(rid, ("ack", "failed"), "acknowledgement")

    def _stage(self, nbytes: int) -> torch.Tensor:
        """The registered staging buffer, grown (re-registered) to hold ``nbytes``."""
        if self._staging is None or self._staging.numel() < nbytes:
            if self._staging is not None:
                self.engine.unregister(self._staging_addr)
            self._staging = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
            self._staging_addr = self.engine.register(self._staging)
        return self._staging


def _local(handle):
    """This rank's cache handle of a request: the handle, or under attention DP its
    ReplicaHandle's ``local`` (None on a rank of another replica: it writes nothing)."""
    return getattr(handle, "local", handle)


def _shard(engine) -> tuple[int, int] | None:
    """Under attention TP, ``(size, rank)`` of this rank's attention-TP group when the
    format splits its tensors by head (:func:`shard_runs` says which rows it writes);
    ``(0, 0)``: nothing (a format every rank holds whole, which attention-TP rank 0
    writes); None: whole tensors (no attention TP, or rank 0 of a whole format)."""
    p = engine.parts
    a, A = p.mesh.attn_tp.rank, p.mesh.attn_tp.size
    if A == 1:
        return None
    if not p.family.export_splits_heads:
        return None if a == 0 else (0, 0)
    return A, a


def shard_runs(meta, layer: int, name: str, runs: list[tuple[int, int, int]], size: int,
               rank: int) -> list[tuple[int, int, int]]:
    """The runs of attention-TP rank ``rank``'s share of tensor ``name`` (``runs``: the whole
    tensor's span, one a row along dim 0, before the token dimension, or a state's one run,
    cut into its rows here): its local row ``j``
    is the whole tensor's row the format's ``take_heads`` gives it (K/V heads, a state's
    channels or heads), written unless a lower rank holds the same row
    (a KV head replicated over ranks: its first holder writes it)."""
    count = meta.tensor_shape(layer, name)[0]
    if len(runs) == 1 and count > 1:  # a whole tensor (a state) in one run: a run a row
        (s, d, n), = runs
        runs = [(o * (n // count), d + o * (n // count), n // count) for o in range(count)]
    rows = torch.arange(len(runs)).view(-1, 1)
    mine = meta.take_heads(layer, name, rows, size, rank).view(-1).tolist()
    earlier = {r for b in range(rank) for r in meta.take_heads(layer, name, rows, size, b).view(-1).tolist()}
    n = runs[0][2] if runs else 0
    return [(j * n, runs[r][1], n) for j, r in enumerate(mine) if r not in earlier]
