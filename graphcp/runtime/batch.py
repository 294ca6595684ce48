"""The batch types, and the per-rank preparation of a batch.

A forward runs one phase (graphcp.attention.phase) on a :class:`PreparedBatch`, whichever
phase: this rank's rows (token ids, positions, cache slots) and attention metadata. A
phase's planner (:class:`Preparer`, the one preparation protocol) makes it: it checks the
call's inputs (every refusal a ``BatchError`` that changes nothing), checks that every
rank was given the same (a fingerprint), reserves the KV where the cache mode puts it and
builds this rank's inputs; ``abort`` gives the reservation back. The prefill's planner is
:class:`BatchPreparer` (here: a list of :class:`Request` validated by the rules of
:data:`BATCH_RULES`, planned with the CP layout); the decode step's is
graphcp.runtime.decode.plan.DecodePlanner. The outputs and the one :class:`ForwardInfo`
of both phases are here too. All of it is host code: nothing here runs the model.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter
from typing import Any, Callable, ClassVar, Literal, Protocol, Sequence

import numpy as np
import torch

from graphcp.attention.base import AttentionMetadata
from graphcp.attention.kv_exchange import AllGatherPlanner
from graphcp.attention.phase import PREFILL, Phase
from graphcp.checks import check_int
from graphcp.cp import Layout, Plan
from graphcp.dist import CPGroup
from graphcp.errors import BatchError, GraphcpError
from graphcp.jit import host_kernel
from graphcp.kv.decode import DecodeSlots
from graphcp.kv.handle import KVCacheFull, KVHandle, KVHandleError
from graphcp.kv.paged import PagedKVCache
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
    """How one forward ran, in either phase: on its bucket's graph or eagerly (and why)."""

    path: Literal["eager", "graph"]
    capacity: int  # rows the body ran on (bucket capacity, or the unpadded max)
    required: int  # the largest rank's rows (a decode step: its requests)
    fallback: str | None = None  # why a graph-mode forward ran eagerly
    timings: dict[str, float] = field(default_factory=dict)
    #: per-forward figures a stats report lists as they are (JSON-able values keyed by
    #: name: bytes a rank sent or received per kind of exchange, choices made, ...)
    stats: dict[str, Any] = field(default_factory=dict)
    phase: Phase = PREFILL
    #: the replay's launches: its graph's segments and breaks (None on the eager path)
    launches: int | None = None

    @property
    def bucket(self) -> int | None:
        """The bucket replayed (its rows: a prefill's local rows, a decode step's requests);
        None on the eager path."""
        return self.capacity if self.path == "graph" else None


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


@dataclass
class DecodeOutput:
    """One decode step's outputs (``PrefillEngine.decode``; docs/decode.md): what reaches
    the host is the next tokens (greedy, chosen on the device); the logits only when asked."""

    tokens: np.ndarray  # int64 [B]: each request's greedy next token (argmax of its logits), the same on every rank
    handles: list[KVHandle]  # each request's KV, one token longer: pass them to the next step
    info: ForwardInfo
    #: float32 [B, vocab], each request's next-token logits (``logits=True``; None otherwise)
    logits: torch.Tensor | None = None
    #: bool [B], whether each next token is one of the step's ``stop`` tokens (None: none given)
    stopped: np.ndarray | None = None


@dataclass(slots=True)
class PreparedBatch:
    """Host-side result of planning one batch on this rank, in its phase: a prefill's new
    tokens split over the CP ranks by ``plan``, or a decode step's one new token a request,
    the same rows on every rank (``decode``: where each token lands)."""

    plan: Plan | None  # the CP layout's plan of a prefill (None: a decode step)
    seq_ids: list[int]
    ids: np.ndarray  # [n] this rank's rows: token ids,
    positions: np.ndarray  # [n] absolute positions
    slots: np.ndarray  # [n] and KV cache slots (-1: a row this rank does not store)
    meta: AttentionMetadata
    seg_page_table: np.ndarray | None
    #: the rows each rank's forward must hold: the largest rank's (a prefill: the plan's
    #: max_local_rows), every request's new one (a decode step)
    rows: int
    plan_s: float = 0.0  # host time of prepare()
    #: the cached prefixes' pages, for a cache that fetches them per layer (LayerSplit)
    prefix_pages: np.ndarray | None = None
    #: the KV exchange's own plan of this forward in its phase (a sharded cache's ring, a
    #: decode step's merge; None: none)
    kv_plan: Any = None
    #: this forward's figures as the body runs it (ForwardInfo.stats): the engine copies them
    stats: dict[str, Any] = field(default_factory=dict)
    phase: Phase = PREFILL
    #: a decode step's reservation: where each request's new token lands (None: a prefill)
    decode: DecodeSlots | None = None


class Preparer(Protocol):
    """A phase's planner: checks a call's inputs (a BatchError changes nothing), that every
    rank was given the same, reserves their KV and builds this rank's :class:`PreparedBatch`
    of its phase; :meth:`abort` gives back what it reserved (its forward failed)."""

    phase: ClassVar[Phase]

    def prepare(self, *inputs: Any, call_args: Sequence[int] = ()) -> PreparedBatch: ...

    def abort(self, prep: PreparedBatch) -> None: ...


@dataclass
class BatchPreparer:
    """The prefill's planner: validates, plans and reserves one batch on this rank (see
    the module doc)."""

    phase: ClassVar[Phase] = PREFILL

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
        nothing). The rules are :data:`BATCH_RULES`; the fast path (:func:`_check_batch`)
        says "all pass" or falls through to :meth:`_validate_each`, which words the error."""
        checked = _check_batch(batch, self.kv, self.vocab_size, min(self.max_context, self.kv.capacity_tokens),
                               self.max_requests)
        return checked if checked is not None else self._validate_each(batch)

    def _validate_each(self, batch: Sequence[Request]) -> CheckedBatch:
        """:data:`BATCH_RULES` request by request (:func:`check_each`): the reference the
        fast path agrees with, and the path that names the first bad request and position."""
        return check_each(batch, BatchLimits(self.kv, self.vocab_size, self.max_context, self.max_requests))

    def _check_consistency(self, group: CPGroup, flat: np.ndarray, extend: np.ndarray, prefix: np.ndarray, batch,
                           call_args: Sequence[int] = ()) -> None:
        """One small all-gather of a batch fingerprint (:func:`batch_fingerprint`): about
        0.5 ms on gloo at 2 ranks, tens of microseconds on NCCL, plus ~1 us per 4K tokens
        to hash."""
        ids = [-1 if r.prefix is None else r.prefix.seq_id for r in batch]
        fp = torch.tensor([batch_fingerprint(flat, extend, prefix, ids, call_args)], dtype=torch.int64)
        check_fingerprints(group.all_gather_rows(fp.to(self.device)).cpu(), group.rank)

    def rank_inputs(self, plan: Plan, seq_ids: list[int], flat: np.ndarray,
                    seq_rows: np.ndarray | None = None) -> PreparedBatch:
        """This rank's host inputs for one planned batch (``flat``: the batch's token
        ids in batch order, as :meth:`_validate` returns them; ``seq_rows``: the
        sequences' page-table rows when the caller has them, as ``kv.reserve`` returns)."""
        with nvtx_range("prepare", category="host"):
            ins = self.planner.rank_inputs(plan, self.kv, seq_ids, self.group.rank, flat, self.device, seq_rows)
            return PreparedBatch(plan, seq_ids, ins.ids, ins.positions, ins.slots, ins.meta, ins.seg_page_table,
                                 plan.max_local_rows, kv_plan=ins.plan)


def batch_fingerprint(flat: np.ndarray, extend: Sequence[int], prefix: Sequence[int], prefix_ids: Sequence[int],
                      call_args: Sequence[int] = ()) -> list[int]:
    """What every rank given the same batch computes alike: CRC32 of the token ids
    (``flat``, in batch order), CRC32 and sum of the lengths, the prefixes' ids (a cache
    handle's, -1 for none) and the call's options as integers."""
    shape = np.concatenate([[len(extend)], np.asarray(extend, dtype=np.int64), np.asarray(prefix, dtype=np.int64),
                            np.asarray(prefix_ids, dtype=np.int64),
                            np.asarray(call_args, dtype=np.int64)]).astype(np.int64)
    return [zlib.crc32(np.ascontiguousarray(flat).data), zlib.crc32(shape.tobytes()), int(shape.sum())]


def check_fingerprints(every: torch.Tensor, rank: int, peers: Sequence[int] | None = None) -> None:
    """ConsistencyError on this ``rank`` (one line) unless every rank's fingerprint (a
    row of ``every``, gathered over the group) equals its own; ``peers``: the ranks
    whose rows must equal (default: all)."""
    peers = range(every.shape[0]) if peers is None else peers
    differ = [r for r in peers if not torch.equal(every[r], every[rank])]
    if differ:
        raise ConsistencyError(
            f"rank {rank}: ranks {differ} were given a different batch (fingerprint {every[rank].tolist()} "
            f"vs {[every[r].tolist() for r in differ]}); every rank must call prefill with the same requests"
        )


_INT64_MAX = np.iinfo(np.int64).max
_num_tokens_of = attrgetter("num_tokens")
_INT64 = {np.dtype(np.int64)}
_REQUEST = {Request}
#: the token dtypes the fast path takes (native integers; others fall through to the
#: per-request path, which takes or words them)
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


# ---- the batch's rules: one table (BATCH_RULES), applied request by request by check_each;
# ---- the fast path (_check_batch) covers the same table and may only say "all pass"


@dataclass(frozen=True)
class BatchLimits:
    """What a batch is checked against: the preparer's cache and limits."""

    kv: PagedKVCache  # the cache a prefix must be live in, and whose pool a request must fit
    vocab_size: int
    max_context: int  # the model's context: cached + new tokens of one request
    max_requests: int | None = None  # the most requests a batch may hold (sized backends); None: any number


@dataclass(slots=True)
class _Walk:
    """The per-request path's state over one batch: the request the request rules are
    on, what the rules before found of it, and what the later rules need of the
    requests that passed."""

    batch: Any
    limits: BatchLimits
    j: int = -1  # the request's index in the batch
    request: Any = None
    tokens: np.ndarray | None = None  # its token ids, as the token-array rule read them
    cached: int = 0  # its prefix's tokens (0 without one)
    extended: dict[int, int] = field(default_factory=dict)  # seq_id -> the request extending it
    ids: list[np.ndarray] = field(default_factory=list)  # int64: each passed request's token ids
    flat: np.ndarray | None = None  # the batch's ids, concatenated (the vocabulary rule)

    def at(self, j: int, request: Any) -> None:
        """Move to request ``j`` (nothing of the one before carries over)."""
        self.j, self.request, self.tokens, self.cached = j, request, None, 0


@dataclass(frozen=True)
class Rule:
    """One rule every batch must pass. ``check`` is how the per-request path applies it
    (a BatchError naming the request, and position, that breaks it); ``fast`` is how
    the fast path (:func:`_check_batch`) covers it. The two must pass exactly the same
    batches (tests/test_batch_rules.py holds them to it)."""

    name: str
    #: "batch": once, before any request; "request": each request, in batch order (all of
    #: a request's rules before the next request's); "ids": once every request passed the rest
    scope: Literal["batch", "request", "ids"]
    check: Callable[[_Walk], None]
    fast: str


def check_container(batch: Any) -> None:
    """The container rule: a batch is a non-empty sequence (not a string; not a generator,
    which the preparer could read only once)."""
    if isinstance(batch, (str, bytes)) or not isinstance(batch, SequenceABC):
        raise BatchError(f"a batch must be a list of graphcp.Request, got {type(batch).__name__}")
    if len(batch) == 0:
        raise BatchError("empty batch: prefill needs at least one request")


def check_item_type(item: Any, j: int) -> None:
    """The item-type rule: batch item ``j`` is a :class:`Request` (a subclass too)."""
    if not isinstance(item, Request):
        raise BatchError(f"batch item {j}: expected a graphcp.Request, got {type(item).__name__} "
                         "(wrap token ids as Request(tokens))")


def request_tokens(tokens: Any, j: int) -> np.ndarray:
    """The token-array rule: request ``j``'s token ids as a 1-D integer ndarray (a CPU
    tensor's memory, an accelerator's tensor copied); BatchError naming the request for anything
    else (ragged or nested lists, floats, strings, bools, objects, uint64 ids past int64)."""
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


def _container(w: _Walk) -> None:
    check_container(w.batch)


def _max_requests(w: _Walk) -> None:
    most = w.limits.max_requests
    if most is not None and len(w.batch) > most:
        raise BatchError(f"batch has {len(w.batch)} requests; the attention backend was sized for "
                         f"RuntimeConfig.max_requests={most}")


def _item_type(w: _Walk) -> None:
    check_item_type(w.request, w.j)


def _token_array(w: _Walk) -> None:
    w.tokens = request_tokens(w.request.tokens, w.j)


def _request_not_empty(w: _Walk) -> None:
    if w.tokens.size == 0:
        raise BatchError(f"request {w.j} is empty: every request needs at least one new token")


def _prefix_live(w: _Walk) -> None:
    """A prefix is a live, current handle of this cache (KVHandleError, a BatchError)."""
    handle = w.request.prefix
    if handle is not None:
        try:
            w.limits.kv.check_handle(handle)
        except KVHandleError as e:
            raise KVHandleError(f"request {w.j}: {e}") from None
        w.cached = handle.num_tokens


def _prefix_once(w: _Walk) -> None:
    """Two requests extending one sequence would both write its next positions."""
    handle = w.request.prefix
    if handle is not None:
        first = w.extended.setdefault(handle.seq_id, w.j)
        if first != w.j:
            raise KVHandleError(f"requests {first} and {w.j} both extend KV handle seq_id={handle.seq_id}; "
                                "a sequence can be extended once per batch")


def _context(w: _Walk) -> None:
    if w.cached + w.tokens.size > w.limits.max_context:
        raise BatchError(f"request {w.j}: {w.cached} cached + {w.tokens.size} new tokens exceed the model's "
                         f"context of {w.limits.max_context}")


def _pool(w: _Walk) -> None:
    pool = w.limits.kv.capacity_tokens
    if w.cached + w.tokens.size > pool:
        raise KVCacheFull(f"request {w.j}: {w.cached + w.tokens.size} tokens exceed the KV pool of {pool}", "kv_tokens")


def _vocabulary(w: _Walk) -> None:
    # after every request passed the rest (as before the table): one pass over the batch's
    # ids, request by request only to name the culprit
    w.flat = check_vocabulary(w.ids, w.limits.vocab_size)


_LEAST = "_checked_least's one compiled pass over the ids and lengths"

#: The batch's rules, in the order the per-request path (:func:`check_each`) applies them
#: (``scope``: :class:`Rule`); each ``fast`` says how the fast path (:func:`_check_batch`) covers it.
BATCH_RULES: tuple[Rule, ...] = (
    Rule("container", "batch", _container,
         "the same tests of the container; an empty batch holds no Request type and falls through"),
    Rule("max_requests", "batch", _max_requests, "the same test of len(batch)"),
    Rule("item type", "request", _item_type, "every item's type is exactly Request (a subclass falls through)"),
    Rule("token array", "request", _token_array,
         "np.asarray of each request's tokens (a CPU tensor without a copy; what raises falls through), "
         "len() (a 0-d array has none), native integer dtypes only (others fall through), their concatenation 1-D"),
    Rule("non-empty request", "request", _request_not_empty, f"{_LEAST}: the fewest new tokens >= 1"),
    Rule("prefix handle", "request", _prefix_live,
         "kv.prefix_rows (array checks over the handles) raises, and the batch falls through"),
    Rule("prefix once", "request", _prefix_once, "kv.prefix_rows refuses a handle given twice (falls through)"),
    Rule("context", "request", _context, f"{_LEAST}: cached + new <= min(context, pool)"),
    Rule("pool", "request", _pool, f"{_LEAST}: cached + new <= min(context, pool)"),
    Rule("vocabulary", "ids", _vocabulary,
         f"{_LEAST}: every id, seen unsigned, < vocab (a negative id, or a uint64 one past int64, is past it)"),
)
_SCOPES = ("batch", "request", "ids")
_BY_SCOPE = {scope: tuple(r for r in BATCH_RULES if r.scope == scope) for scope in _SCOPES}


def check_each(batch: Any, limits: BatchLimits) -> CheckedBatch:
    """The batch checked by :data:`BATCH_RULES`, rule by rule and request by request: the
    reference the fast path agrees with, and the path that names the first bad request
    and position (a BatchError). It only reads the cache: a refused batch changed nothing."""
    w = _Walk(batch, limits)
    for rule in _BY_SCOPE["batch"]:
        rule.check(w)
    for j, request in enumerate(batch):
        w.at(j, request)
        for rule in _BY_SCOPE["request"]:
            rule.check(w)
        w.ids.append(w.tokens.astype(np.int64, copy=False))
    for rule in _BY_SCOPE["ids"]:
        rule.check(w)
    return _checked(w)


def _checked(w: _Walk) -> CheckedBatch:
    """:func:`check_each`'s result once every rule passed (the fast path's, field by field)."""
    prefixes = [r.prefix for r in w.batch]
    num = len(w.ids)
    lengths = np.array([t.shape[0] for t in w.ids] + [0 if h is None else h.num_tokens for h in prefixes],
                       dtype=np.int64)
    lengths.setflags(write=False)
    return CheckedBatch(w.flat, lengths[:num], lengths[num:], prefixes, w.limits.kv.prefix_rows(prefixes),
                        min(t.shape[0] for t in w.ids))


def _check_batch(batch: Any, kv: PagedKVCache, vocab: int, max_tokens: int,
                 max_requests: int | None = None) -> CheckedBatch | None:
    """The fast path of :data:`BATCH_RULES`: the checked batch, as :func:`check_each`
    gives it, when every rule passes; None otherwise, or when an input is unusual (then
    :func:`check_each` finds and names the culprit). It never refuses a batch itself.
    Array operations over the whole batch (C-level maps over the requests, one
    concatenation and one compiled pass over the ids and lengths: no Python per request
    or token); how it covers each rule is that rule's ``fast``. ``max_tokens``: a
    request's most cached + new tokens, min(context, pool)."""
    if isinstance(batch, (str, bytes)) or not isinstance(batch, SequenceABC):
        return None
    if max_requests is not None and len(batch) > max_requests:
        return None
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


def _checked_least_np(flat: np.ndarray, vocab: int, extend: np.ndarray, prefix: np.ndarray, max_tokens: int) -> int:
    """:func:`_checked_least` as whole-array numpy (the form that runs without numba)."""
    if flat.shape[0] and flat.astype(np.uint64, copy=False).max() >= vocab:  # negative ids wrap past it
        return 0
    if extend.shape[0] and (prefix + extend > max_tokens).any():
        return 0
    return int(extend.min()) if extend.shape[0] else max_tokens + 1


@host_kernel(fallback=_checked_least_np)
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
                raise BatchError(
                    f"{where(j)}, position {p}: token id {int(t[p])} is outside the vocabulary [0, {vocab})")
    return flat


# ---- the call's draft_next, checked against the batch before anything changes


def check_draft_next(batch: Any, given: Any, microbatches: int, *, drafting: bool, vocab_size: int,
                     draft_tokens: Mapping[int, int], cache_id: str) -> np.ndarray | None:
    """A prefill call's ``draft_next`` checked: int64 [R], -1 where the target's greedy
    token goes; None without a draft (``drafting`` False). BatchError (nothing changed)
    for draft_next without a draft, micro-batches with one, a list that is not one token
    (or None) per request, an entry that is not a token id, or a request extending a
    prefix whose last draft row took another token than the request's first
    (``draft_tokens``: seq_id -> that token, for the sequences of the cache ``cache_id``).
    A batch :data:`BATCH_RULES` refuses is left to the preparer, which words it."""
    if not drafting:
        if given is not None:
            raise BatchError("prefill: draft_next needs an engine with a draft (RuntimeConfig.draft)")
        return None
    if microbatches != 1:
        raise BatchError(f"prefill: microbatches={microbatches} with a draft (RuntimeConfig.draft runs one forward a "
                         "batch; expected 1)")
    if isinstance(batch, (str, bytes)) or not isinstance(batch, SequenceABC):
        return np.zeros(0, dtype=np.int64)  # not a batch: the container rule words it
    out = _draft_next_entries(given, len(batch), vocab_size)
    _check_draft_rows(batch, draft_tokens, cache_id)
    return out


def _draft_next_entries(given: Any, n: int, vocab_size: int) -> np.ndarray:
    """int64 [n]: each entry of ``given`` checked as a token id, -1 for None (or no list)."""
    out = np.full(n, -1, dtype=np.int64)
    if given is None:
        return out
    if isinstance(given, (str, bytes)) or not isinstance(given, SequenceABC) or len(given) != n:
        raise BatchError(f"prefill: draft_next must list one token (or None) per request ({n}), got {given!r}"[:300])
    for j, t in enumerate(given):
        if t is not None:
            out[j] = check_int(t, f"draft_next[{j}] (a token id)", lo=0, hi=vocab_size - 1, where="prefill",
                               err=BatchError)
    return out


def _check_draft_rows(batch: Sequence, draft_tokens: Mapping[int, int], cache_id: str) -> None:
    """A request extending a prefix continues from the token that prefix's last draft row
    took, or that row's draft K/V would be stale. Requests the batch's rules refuse are
    skipped (the preparer words them)."""
    for j, r in enumerate(batch):
        h = r.prefix if isinstance(r, Request) else None
        want = draft_tokens.get(h.seq_id) if isinstance(h, KVHandle) and h.cache_id == cache_id else None
        if want is None:
            continue
        try:
            first = int(request_tokens(r.tokens, j)[0])
        except (BatchError, IndexError):  # not token ids, or none: the preparer words it
            continue
        if first != want:
            raise BatchError(
                f"request {j} extends a prefix whose last draft row took token {want}, but its first new token "
                f"is {first}: that row's draft K/V would be stale (prefill a prompt in chunks with draft_next=the "
                "next chunk's first token)")
