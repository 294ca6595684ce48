"""The decode phase's planner: a decode step's checks, its reservation and host inputs.

``decode(handles, tokens)`` adds ``tokens[j]`` after the KV of ``handles[j]``: a prepared
batch (graphcp.runtime.batch.PreparedBatch) of the decode phase, one row a request, the
same rows on every rank. The checks refuse (a BatchError naming the request, nothing
changed) an empty batch, anything but a live, current KV handle of this engine given
once, a token that is not an id of the vocabulary, and a request whose next position is
past the model's context (or the pool); then every rank must have been given the same
step (its fingerprint), the cache mode reserves each token where it lands
(graphcp.kv.decode), and the step's attention metadata is one segment a request.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import numpy as np
import torch

from graphcp.attention.base import AttentionMetadata
from graphcp.attention.phase import DECODE, Phase
from graphcp.dist import CPGroup, host_group
from graphcp.errors import BatchError
from graphcp.kv.decode import DecodeSlots
from graphcp.kv.handle import KVCacheFull, KVHandle, KVHandleError
from graphcp.kv.paged import PagedKVCache
from graphcp.runtime.batch import ConsistencyError, PreparedBatch


def step_tokens(tokens: Any, n: int, vocab: int, most_rows: int | None = None) -> np.ndarray:
    """int64 [n, rows]: each request's token ids, one (``[n]``) or the same count of them
    (``[n, rows]``, a verify step: the pending token and the draft's), each in [0, vocab);
    BatchError naming the request otherwise. ``most_rows``: the most a request may give."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise BatchError(f"decode: tokens must be integer ids, got a {tokens.dtype} tensor")
        t = tokens.detach().cpu().numpy()
    else:
        try:
            t = np.asarray(tokens)
        except (ValueError, TypeError, OverflowError) as e:
            raise BatchError(f"decode: tokens must be one integer id per request ({e})") from None
    if t.ndim not in (1, 2) or t.shape[0] != n or (t.size and t.dtype.kind not in "iu") or \
            (t.ndim == 2 and t.shape[1] < 1):
        raise BatchError(f"decode: tokens must be one integer id per request ({n}), or [{n}, rows] for a step of "
                         f"several rows a request, got {t.dtype} {t.shape}")
    t = t.reshape(n, -1)
    if most_rows is not None and t.shape[1] > most_rows:
        raise BatchError(f"decode: {t.shape[1]} rows a request is over the most a step takes ({most_rows})")
    bad = np.argwhere((t < 0) | (t >= vocab)) if t.size else []
    if len(bad):
        j, i = (int(x) for x in bad[0])
        raise BatchError(f"decode: request {j}: token id {int(t[j, i])} is outside the vocabulary [0, {vocab})")
    return t.astype(np.int64)


def step_rows(handles: Any, kv: PagedKVCache) -> np.ndarray:
    """The handles' rows of the cache's page table: each a live, current KVHandle of this
    cache, given once (KVHandleError, a BatchError, naming the request otherwise)."""
    if isinstance(handles, (str, bytes)) or not isinstance(handles, SequenceABC):
        raise BatchError(f"decode: handles must be a list of KVHandle, got {type(handles).__name__}")
    if len(handles) == 0:
        raise BatchError("decode: empty batch: a decode step needs at least one request")
    handles = list(handles)
    for j, h in enumerate(handles):
        if not isinstance(h, KVHandle):
            raise KVHandleError(f"decode: request {j}: expected a KVHandle this engine returned, got "
                                f"{type(h).__name__}")
    try:
        return kv.prefix_rows(handles)
    except KVHandleError:
        pass
    seen: dict[int, int] = {}
    for j, h in enumerate(handles):  # word what is wrong, naming the request
        try:
            kv.check_handle(h)
        except KVHandleError as e:
            raise KVHandleError(f"decode: request {j}: {e}") from None
        if seen.setdefault(h.seq_id, j) != j:
            raise KVHandleError(f"decode: requests {seen[h.seq_id]} and {j} are the same sequence "
                                f"(seq_id={h.seq_id}); a sequence takes one token a step")
    raise AssertionError("prefix_rows refused handles that pass one by one")  # pragma: no cover


def check_room(handles: Sequence[KVHandle], max_context: int, pool_tokens: int, n: int = 1) -> None:
    """Every request has room for ``n`` more tokens: within the model's context and the pool."""
    more = "another" if n == 1 else f"{n} more (a step of {n} rows a request)"
    for j, h in enumerate(handles):
        if h.num_tokens + n > max_context:
            raise BatchError(f"decode: request {j} holds {h.num_tokens} tokens, the model's context of "
                             f"{max_context}: no position is left for {more}")
        if h.num_tokens + n > pool_tokens:
            raise KVCacheFull(f"decode: request {j} holds {h.num_tokens} tokens, the KV pool's {pool_tokens}: "
                              f"no room for {more}", "kv_tokens")


def check_same_step(group: CPGroup, tokens: np.ndarray, handles: Sequence[KVHandle], call: Sequence[int]) -> None:
    """Every rank was given the same step (ConsistencyError otherwise): one small all-gather
    of a fingerprint of the tokens, the sequences, their lengths and the call's options.
    ``group``: a gloo group (graphcp.dist.host_group): the fingerprint is host memory, so
    the check never waits for the device (no upload, no device read)."""
    if not group.distributed:
        return
    shape = np.array([len(tokens), *[h.seq_id for h in handles], *[h.num_tokens for h in handles], *call],
                     dtype=np.int64)
    fp = torch.from_numpy(np.array([[zlib.crc32(tokens.tobytes()), zlib.crc32(shape.tobytes()), int(shape.sum())]],
                                   dtype=np.int64))
    every = group.all_gather_rows(fp)
    differ = [r for r in range(group.size) if not torch.equal(every[r], every[group.rank])]
    if differ:
        raise ConsistencyError(f"rank {group.rank}: ranks {differ} were given a different decode step; every rank "
                               "must call decode with the same handles and tokens")


def step_metadata(kv: PagedKVCache, slots: DecodeSlots, device: torch.device) -> AttentionMetadata:
    """One segment a row: its new row over the ``local_lens[j]`` tokens this rank holds
    of its request, in its pages (non-causal: every held token is before the new one, and a
    rank may hold none of a request, whose row then gets output 0 and LSE -inf). A verify
    step's rows of one request are causal among them by their lengths: each row's stops at
    the tokens this rank holds up to its own position (graphcp.kv.decode.stack_steps)."""
    B, lens = slots.num_requests, slots.local_lens
    most = int(lens.max())
    buf, cu, kv_lens, table = AttentionMetadata.host_buffers(B, max(1, kv.pages_for(most)))
    cu[:] = np.arange(B + 1)
    kv_lens[:] = lens
    kv.page_table_rows(slots.rows, table.shape[1], out=table)
    return AttentionMetadata._live(cu, kv_lens, table, kv.page_size, 1, most, device, buf, False)


@dataclass
class DecodePlanner:
    """The decode phase's planner (graphcp.runtime.batch.Preparer): checks, reserves and
    plans one decode step on this rank (see the module doc)."""

    phase: ClassVar[Phase] = DECODE

    kv: PagedKVCache
    #: the ranks that must be given the same step (the stage's: attention TP ranks too)
    group: CPGroup
    vocab_size: int
    max_context: int
    device: torch.device
    #: the exchange's decode plan of a step of n rows (its merge): graphcp.runtime.body.Body.plan_decode
    plan: Callable[[int], Any]
    check_consistency: bool = True
    #: the most rows a request may give a step (a verify step's; None: no limit)
    most_rows: int | None = None
    #: the group's ranks over gloo, made on the first check (graphcp.dist.host_group)
    _host: CPGroup | None = field(default=None, init=False, repr=False)

    def prepare(self, handles: Sequence[KVHandle], tokens: Any, call_args: Sequence[int] = ()) -> PreparedBatch:
        """Nothing changes when it raises; :meth:`abort` undoes it. ``call_args``: the
        call's options as integers (every rank must agree on them). ``tokens``: one a
        request, or ``[requests, n]``: a verify step of n rows a request at its next n
        positions, causal among them (:meth:`accept` then keeps each request's first rows)."""
        rows = step_rows(handles, self.kv)
        toks = step_tokens(tokens, len(handles), self.vocab_size, self.most_rows)
        n = toks.shape[1]
        if n > 1 and self.kv.state_pools():
            raise BatchError(f"decode: {n} rows a request on a cache with per-request states (a linear-attention "
                             "layer's): its states take one token a step; give one token a request")
        check_room(handles, self.max_context, self.kv.capacity_tokens, n)
        toks = toks.reshape(-1)
        if self.check_consistency and self.group.distributed:
            if self._host is None:
                self._host = host_group(self.group)
            check_same_step(self._host, toks, handles, (*call_args, n))
        slots = self.kv.reserve_rows(list(handles), rows, n)
        try:
            return self.batch(slots, toks)
        except BaseException:
            self.kv.rollback_decode(slots)
            raise

    def batch(self, slots: DecodeSlots, ids: np.ndarray) -> PreparedBatch:
        """A decode-phase batch of ``slots``' rows with token ``ids`` (a step's own, or some of
        a verify step's rows that a draft runs over again: :meth:`rows`)."""
        meta = step_metadata(self.kv, slots, self.device)
        return PreparedBatch(None, slots.seq_ids, ids, slots.positions, slots.slots, meta, None, len(ids),
                             kv_plan=self.plan(len(ids)), phase=DECODE, decode=slots)

    def rows(self, prep: PreparedBatch, index: np.ndarray, ids: np.ndarray) -> PreparedBatch:
        """Rows ``index`` of a prepared verify step (still reserved) as a batch of their own,
        taking ``ids``: the draft layer's steps over the step's positions."""
        return self.batch(prep.decode.subset(index), np.asarray(ids, dtype=np.int64))

    def accept(self, prep: PreparedBatch, keep: np.ndarray) -> None:
        """After a verify step: request j keeps its first ``keep[j]`` rows' tokens, the rest
        of its reservation given back on every rank (the KV of rejected rows: every layer's,
        the draft's too)."""
        if prep.decode.steps:
            self.kv.trim_decode(prep.decode, keep)

    def abort(self, prep: PreparedBatch) -> None:
        """Give back what a prepared step reserved (its forward failed)."""
        self.kv.rollback_decode(prep.decode)
