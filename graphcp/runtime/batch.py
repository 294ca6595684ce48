"""The batch types, and the per-rank preparation of a batch.

``BatchPreparer.prepare`` turns a list of :class:`Request` into this rank's
:class:`PreparedBatch`: it validates the batch (every refusal is a ``BatchError``
and changes nothing), checks that every rank was given the same batch, plans it
with the CP layout, reserves its KV pages and builds this rank's host inputs
(token ids, positions, cache slots, attention metadata). ``abort`` gives the
pages back. All of it is host code: nothing here runs the model.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter
from typing import Any, Callable, Literal, Sequence

import numpy as np
import torch

from graphcp.attention.base import AttentionMetadata
from graphcp.attention.kv_exchange import AllGatherPlanner
from graphcp.cp import Layout, Plan
from graphcp.dist import CPGroup
from graphcp.errors import BatchError, GraphcpError
from graphcp.jit import host_kernel
from graphcp.kv.paged import KVHandle, KVHandleError, PagedKVCache
from graphcp.nvtx_ranges import nvtx_range


class ConsistencyError(GraphcpError, RuntimeError):
    """Ranks were given different batches (the SPMD contract is broken)."""


@dataclass
class Request:
    """New tokens of one request, optionally extending an already-cached prefix."""

    tokens: Sequence[int] | np.ndarray | torch.Tensor
    prefix: KVHandle | None = None


@dataclass
class ForwardInfo:
    path: Literal["eager", "graph"]
    capacity: int  # local rows the body ran on (bucket capacity, or the unpadded max)
    required: int  # the largest rank's local rows
    fallback: str | None = None  # why a graph-mode forward ran eagerly
    timings: dict[str, float] = field(default_factory=dict)
    #: per-forward figures a stats report lists as they are (JSON-able values keyed by
    #: name: bytes a rank sent or received per kind of exchange, choices made, ...)
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class DraftOutput:
    """What an EAGLE-3 draft (``RuntimeConfig.draft``) gives per request, identical on every rank."""

    logits: torch.Tensor  # float32 [R, draft_vocab]: the draft's logits at each request's last position
    draft_to_target: torch.Tensor  # int64 [draft_vocab]: the target id of each draft id (arange + d2t)
    hidden: torch.Tensor  # float32 [R, hidden]: the draft's last row before its norm (a next draft step's input)
    next_tokens: torch.Tensor  # int64 [R]: the token each request's last draft row took (sampled or given)
    all_logits: list[torch.Tensor] | None = None  # float32 [new_tokens_i, draft_vocab] when all logits were asked


@dataclass
class PrefillOutput:
    last_logits: torch.Tensor  # float32 [R, vocab], identical on every rank
    handles: list[KVHandle]  # each request's KV (prefix + new tokens): pass as the next chunk's prefix
    logits: list[torch.Tensor] | None  # float32 [new_tokens_i, vocab] when asked
    info: ForwardInfo
    #: float32 [new_tokens_i, len(layers) * hidden] per request when auxiliary layers
    #: were asked: the output of each asked decoder layer, in the order asked
    aux_hidden: list[torch.Tensor] | None = None
    #: the draft's outputs (an engine with ``RuntimeConfig.draft``; None otherwise)
    draft: DraftOutput | None = None


@dataclass(slots=True)
class PreparedBatch:
    """Host-side result of planning one batch on this rank."""

    plan: Plan
    seq_ids: list[int]
    ids: np.ndarray  # [n] this rank's rows: token ids,
    positions: np.ndarray  # [n] absolute positions
    slots: np.ndarray  # [n] and KV cache slots (the exchange all-gathers them with the rows)
    meta: AttentionMetadata
    seg_page_table: np.ndarray
    plan_s: float = 0.0  # host time of prepare()
    #: the cached prefixes' pages, for a cache that fetches them per layer (LayerSplit)
    prefix_pages: np.ndarray | None = None
    #: the KV exchange's own plan of this forward (a sharded cache's ring; None: none)
    kv_plan: Any = None
    #: this forward's figures as the body runs it (ForwardInfo.stats): the engine copies them
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class BatchPreparer:
    """Validates, plans and reserves one batch on this rank (see the module doc)."""

    layout: Layout
    kv: PagedKVCache
    group: CPGroup
    vocab_size: int
    max_context: int
    device: torch.device
    check_consistency: bool = True
    #: the most requests a batch may hold (kernel backends sized for
    #: ``RuntimeConfig.max_requests``); None: any number
    max_requests: int | None = None
    #: the KV exchange's host side: this rank's inputs of a planned batch
    #: (graphcp.attention.kv_exchange; a sharded cache's ring planner writes local slots,
    #: per-step metadata and the per-batch exchange choice). None: the all-gather's
    planner: Any = None
    #: the ranks that must be given the same batch (every stage of a pipeline); None: ``group``
    consistency_group: CPGroup | None = None

    def __post_init__(self) -> None:
        if self.planner is None:
            self.planner = AllGatherPlanner()

    def prepare(self, batch: Sequence[Request], verified: bool = False,
                call_args: Sequence[int] = ()) -> PreparedBatch:
        """Validate, check SPMD consistency, plan, reserve KV and build this rank's
        host metadata. Nothing changes when it raises; :meth:`abort` undoes it.
        ``verified``: the batch was checked consistent already (:meth:`validate`);
        ``call_args``: the call's options every rank must agree on, as integers."""
        t0 = time.perf_counter()
        with nvtx_range("plan", category="host"):
            checked = self._validate(batch)
            if not verified:
                self._check_consistency_of(batch, checked, call_args)
            plan = self.layout.plan_checked(checked.extend, checked.prefix, checked.min_extend)
        seq_ids, rows = self.kv.reserve(checked.prefixes, checked.rows, checked.extend)
        try:
            prep = self.rank_inputs(plan, seq_ids, checked.flat, rows)
        except BaseException:
            self.kv.rollback(seq_ids, checked.extend)
            raise
        prep.prefix_pages = self.kv.prefix_pages(checked.prefixes)
        prep.plan_s = time.perf_counter() - t0
        return prep

    def validate(self, batch: Sequence[Request], call_args: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """Check a batch (BatchError naming the request) and that every rank was given
        the same batch and options; the token ids flattened in batch order and each
        request's number of new tokens."""
        checked = self._validate(batch)
        self._check_consistency_of(batch, checked, call_args)
        return checked.flat, checked.extend

    def _check_consistency_of(self, batch: Sequence[Request], checked: CheckedBatch,
                              call_args: Sequence[int]) -> None:
        group = self.consistency_group or self.group
        if self.check_consistency and group.distributed:
            self._check_consistency(group, checked.flat, checked.extend, checked.prefix, batch, call_args)

    def abort(self, prep: PreparedBatch) -> None:
        """Give back the KV a prepared batch reserved (its forward failed or was dropped)."""
        self.kv.rollback(prep.seq_ids, prep.plan.extend_lens)

    def _validate(self, batch: Sequence[Request]) -> CheckedBatch:
        """The checked batch; BatchError naming the request (and position) when something
        is wrong (types included: every refused batch is a BatchError, and changes
        nothing). Array checks over the whole batch (:func:`_check_batch`); a batch they
        do not pass goes through :meth:`_validate_each`, which words the error."""
        self._check_batch_container(batch)
        checked = _check_batch(batch, self.kv, self.vocab_size, min(self.max_context, self.kv.capacity_tokens))
        return checked if checked is not None else self._validate_each(batch)

    def _check_batch_container(self, batch: Sequence[Request]) -> None:
        if isinstance(batch, (str, bytes)) or not isinstance(batch, SequenceABC):
            raise BatchError(f"a batch must be a list of graphcp.Request, got {type(batch).__name__}")
        if len(batch) == 0:
            raise BatchError("empty batch: prefill needs at least one request")
        if self.max_requests is not None and len(batch) > self.max_requests:
            raise BatchError(f"batch has {len(batch)} requests; the attention backend was sized for "
                             f"RuntimeConfig.max_requests={self.max_requests}")

    def _validate_each(self, batch: Sequence[Request]) -> CheckedBatch:
        """:meth:`_validate` request by request: the reference the array checks must
        agree with, and the path that names the first bad request and position."""
        vocab = self.vocab_size
        out = []
        extended: dict[int, int] = {}  # seq_id -> the request extending it
        for j, r in enumerate(batch):
            if not isinstance(r, Request):
                raise BatchError(f"batch item {j}: expected a graphcp.Request, got {type(r).__name__} "
                                 "(wrap token ids as Request(tokens))")
            t = _token_array(r.tokens, j)
            if t.size == 0:
                raise BatchError(f"request {j} is empty: every request needs at least one new token")
            have = 0
            if r.prefix is not None:
                try:
                    self.kv.check_handle(r.prefix)
                except KVHandleError as e:
                    raise KVHandleError(f"request {j}: {e}") from None
                first = extended.setdefault(r.prefix.seq_id, j)
                if first != j:
                    raise KVHandleError(f"requests {first} and {j} both extend KV handle seq_id={r.prefix.seq_id}; "
                                        "a sequence can be extended once per batch")
                have = r.prefix.num_tokens
            if have + t.size > self.max_context:
                raise BatchError(f"request {j}: {have} cached + {t.size} new tokens exceed the model's context of "
                                 f"{self.max_context}")
            if have + t.size > self.kv.capacity_tokens:
                raise BatchError(f"request {j}: {have + t.size} tokens exceed the KV pool of {self.kv.capacity_tokens}")
            out.append(t.astype(np.int64, copy=False))
        flat = check_vocabulary(out, vocab)
        prefixes = [r.prefix for r in batch]
        num = len(out)
        lengths = np.array([t.shape[0] for t in out] + [0 if h is None else h.num_tokens for h in prefixes],
                           dtype=np.int64)
        lengths.setflags(write=False)
        return CheckedBatch(flat, lengths[:num], lengths[num:], prefixes, self.kv.prefix_rows(prefixes),
                            min(t.shape[0] for t in out))

    def _check_consistency(self, group: CPGroup, flat: np.ndarray, extend: np.ndarray, prefix: np.ndarray, batch,
                           call_args: Sequence[int] = ()) -> None:
        """One small all-gather of a batch fingerprint (CRC32 of the token ids, the
        lengths, the prefix handles and the call's options): about 0.5 ms on gloo at 2
        ranks, tens of microseconds on NCCL, plus ~1 us per 4K tokens to hash."""
        crc = zlib.crc32(flat.data)
        shape = np.concatenate([[len(batch)], extend, prefix,
                                [-1 if r.prefix is None else r.prefix.seq_id for r in batch],
                                np.asarray(call_args, dtype=np.int64)]).astype(np.int64)
        fp = torch.tensor([[crc, zlib.crc32(shape.tobytes()), int(shape.sum())]], dtype=torch.int64)
        fp = fp.to(self.device)
        allfp = group.all_gather_rows(fp).cpu()
        rank = group.rank
        differ = [r for r in range(group.size) if not torch.equal(allfp[r], allfp[rank])]
        if differ:
            raise ConsistencyError(
                f"rank {rank}: ranks {differ} were given a different batch (fingerprint {allfp[rank].tolist()} "
                f"vs {[allfp[r].tolist() for r in differ]}); every rank must call prefill with the same requests"
            )

    def rank_inputs(self, plan: Plan, seq_ids: list[int], flat: np.ndarray,
                    seq_rows: np.ndarray | None = None) -> PreparedBatch:
        """This rank's host inputs for one planned batch (``flat``: the batch's token
        ids in batch order, as :meth:`_validate` returns them; ``seq_rows``: the
        sequences' page-table rows when the caller has them, as ``kv.reserve`` returns)."""
        with nvtx_range("prepare", category="host"):
            ins = self.planner.rank_inputs(plan, self.kv, seq_ids, self.group.rank, flat, self.device, seq_rows)
            return PreparedBatch(plan, seq_ids, ins.ids, ins.positions, ins.slots, ins.meta, ins.seg_page_table,
                                 kv_plan=ins.plan)


_INT64_MAX = np.iinfo(np.int64).max
_num_tokens_of = attrgetter("num_tokens")
_INT64 = {np.dtype(np.int64)}
_REQUEST = {Request}
#: the token dtypes the array checks take (native integers; others go request by
#: request, which takes or words them)
_INTEGER_DTYPES = {np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64,
                                          np.uint8, np.uint16, np.uint32, np.uint64)}


@dataclass(slots=True)
class CheckedBatch:
    """A batch that passed validation, as the preparer uses it."""

    flat: np.ndarray  # int64 [tokens]: the token ids, flattened in batch order
    extend: np.ndarray  # int64 [R]: each request's new tokens
    prefix: np.ndarray  # int64 [R]: each request's cached tokens (0 without a prefix)
    prefixes: list  # each request's prefix handle, or None
    #: each prefix's row of the cache's page table, -1 for None; None: no prefix at all
    #: (:meth:`PagedKVCache.prefix_rows`, which the reservation reuses)
    rows: np.ndarray | None = None
    min_extend: int = 0  # the fewest new tokens of a request


def _check_batch(batch: Sequence, kv: PagedKVCache, vocab: int, max_tokens: int) -> CheckedBatch | None:
    """The batch checked with array operations over all of it (C-level maps over the
    requests, one concatenation and one compiled pass over the ids and lengths: no
    Python per request or token); None when any check fails or an input is unusual
    (then :meth:`BatchPreparer._validate_each` finds and names the culprit). Accepts
    exactly what that accepts, with the same result: 1-D integer token ids (arrays,
    CPU tensors, lists), non-empty, every id in ``[0, vocab)``, live distinct prefix
    handles, ``max_tokens`` per request."""
    if set(map(type, batch)) != _REQUEST:
        return None
    prefixes = [r.prefix for r in batch]
    num = len(prefixes)
    try:  # CPU tensors convert without a copy; what cannot convert is worded by the per-request path
        arrays = list(map(np.asarray, [r.tokens for r in batch]))
        extend = np.fromiter(map(len, arrays), np.int64, num)  # (a 0-d array has no len)
    except Exception:  # noqa: BLE001 - any failure: the per-request path says what and where
        return None
    dtypes = {a.dtype for a in arrays}  # (comprehensions: Python 3.11's attribute loads beat attrgetter)
    if not dtypes <= _INTEGER_DTYPES:
        return None
    try:
        rows = kv.prefix_rows(prefixes)
    except KVHandleError:
        return None
    if rows is None:
        prefix = _no_prefix(num)
    else:
        given = rows >= 0
        prefix = np.zeros(num, dtype=np.int64)
        prefix[given] = np.fromiter(map(_num_tokens_of, compress(prefixes, given)), np.int64, int(given.sum()))
        prefix.setflags(write=False)
    try:  # arrays of other ranks do not concatenate, or do but not to 1-D: the per-request path words it
        # uint64 ids past int64 wrap negative here; a negative id, seen unsigned, is >= vocab
        flat = np.concatenate(arrays) if dtypes == _INT64 else np.concatenate(arrays, dtype=np.int64, casting="unsafe")
    except ValueError:
        return None
    if flat.ndim != 1:
        return None
    least = _checked_least(flat, vocab, extend, prefix, max_tokens)
    if least < 1:
        return None
    extend.setflags(write=False)
    return CheckedBatch(flat, extend, prefix, prefixes, rows, least)


@host_kernel
def _checked_least(flat, vocab, extend, prefix, max_tokens):
    """The fewest new tokens of a request when every id of ``flat`` is in ``[0, vocab)``
    (seen unsigned: a negative id is past it) and every request's ``prefix + extend``
    at most ``max_tokens``; 0 otherwise (a request with no new token gives 0 too)."""
    worst = np.uint64(0)
    for i in range(flat.shape[0]):
        worst = max(worst, np.uint64(flat[i]))
    if flat.shape[0] and worst >= vocab:
        return 0
    least = max_tokens + 1
    for j in range(extend.shape[0]):
        least = min(least, extend[j])
        if prefix[j] + extend[j] > max_tokens:
            return 0
    return least


_NO_PREFIX: dict[int, np.ndarray] = {}


def _no_prefix(num: int) -> np.ndarray:
    """int64 [num] zeros, read-only and shared: the prefix lengths of a batch without
    prefixes (plans keep them; no one writes them)."""
    out = _NO_PREFIX.get(num)
    if out is None:
        if len(_NO_PREFIX) > 1024:
            _NO_PREFIX.clear()
        out = _NO_PREFIX[num] = np.zeros(num, dtype=np.int64)
        out.setflags(write=False)
    return out


def check_vocabulary(tokens: Sequence[np.ndarray], vocab: int, where: Callable[[int], str] = "request {}".format
                     ) -> np.ndarray:
    """Every id of every request's ``tokens`` in [0, vocab), or a BatchError naming the
    first bad request (``where(j)``: "request j", or a file's line), position and id.
    The batch's ids, concatenated (checked at once; per request only to name the culprit)."""
    flat = np.concatenate(tokens) if len(tokens) > 1 else np.asarray(tokens[0])
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= vocab):
        for j, t in enumerate(tokens):
            bad = np.flatnonzero((t < 0) | (t >= vocab))
            if bad.size:
                p = int(bad[0])
                raise BatchError(f"{where(j)}, position {p}: token id {int(t[p])} is outside the vocabulary [0, {vocab})")
    return flat


def _token_array(tokens, j: int) -> np.ndarray:
    """A request's token ids as a 1-D integer ndarray; BatchError naming the request for
    anything else (ragged or nested lists, floats, strings, bools, objects)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise BatchError(f"request {j}: tokens must be a 1-D sequence of integer ids, got a {tokens.dtype} tensor")
        t = tokens.detach().cpu().numpy()
    else:
        try:
            t = np.asarray(tokens)
        except (ValueError, TypeError, OverflowError) as e:  # ragged lists, unconvertible items
            raise BatchError(f"request {j}: tokens must be a 1-D sequence of integer ids ({e})") from None
    if t.ndim != 1 or (t.size and t.dtype.kind not in "iu"):
        raise BatchError(f"request {j}: tokens must be a 1-D sequence of integer ids, got {t.dtype} {t.shape}")
    if t.dtype.kind == "u" and t.size and int(t.max()) > _INT64_MAX:  # would wrap to negative ids
        p = int(np.argmax(t > _INT64_MAX))
        raise BatchError(f"request {j}, position {p}: token id {int(t[p])} is outside the vocabulary")
    return t
