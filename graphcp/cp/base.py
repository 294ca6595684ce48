"""The CP layout interface: a layout turns one batch into a :class:`Plan`.

A layout maps ``(extend_lens, prefix_lens, cp_size)`` to a plan. It is pure host
code (numpy), deterministic, and computes the same plan on every rank, so ranks
never have to agree on anything at run time.

Vocabulary (see docs/design.md, "Words" and "Layouts"):

* The *global rows* of a batch are its new tokens flattened in batch order:
  request ``j`` owns rows ``cu_extend[j] .. cu_extend[j + 1]``. The absolute
  position of a row is the request's prefix length plus its offset in the request.
* Every global row is owned by exactly one rank. A rank's *local order* is the
  order its rows sit in its (padded) local buffers.
* A rank's local rows are cut into *segments*: contiguous runs of local rows that
  attend one request's KV with bottom-right causal alignment. Row ``i`` of a
  segment of ``q_len`` rows sees positions ``< kv_len - q_len + i + 1``; ``kv_len``
  counts the prefix. A correct layout gives every row exactly its causal history.
* After a rank-major all-gather of every rank's local rows padded to ``capacity``,
  global row ``g`` sits at ``gather_index(capacity)[g]``.

Concrete layouts live in :mod:`graphcp.cp.zigzag` and :mod:`graphcp.cp.interleave`.
Everything here is vectorised: no per-token (or per-request) Python loops, because
planning runs on the host for every forward.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property
from operator import attrgetter
from typing import Sequence, Union

import numpy as np

from graphcp.jit import host_kernel

__all__ = ["Layout", "Plan", "RankPlan", "causal_work_per_rank", "IntArrayLike"]

IntArrayLike = Union[Sequence[int], np.ndarray]

# --------------------------------------------------------------------------- helpers

_ARANGE: np.ndarray = np.arange(1 << 16, dtype=np.int64)
_ARANGE.flags.writeable = False


def arange(n: int) -> np.ndarray:
    """``np.arange(n)`` as a read-only view of a cached buffer (no allocation).

    Allocating and filling a fresh ``arange`` of a batch's size costs more than
    every other step of a plan together; slicing a cached one is free.
    """
    global _ARANGE
    if n > _ARANGE.shape[0]:
        size = 1 << max(int(n - 1).bit_length(), 16)
        buf = np.arange(size, dtype=np.int64)
        buf.flags.writeable = False
        _ARANGE = buf
    return _ARANGE[:n]


@host_kernel
def expand_runs(seg_shift, cu, per_row):
    """Every row of a rank's segments from their runs: ``per_row[k, i] = seg_shift[k, s]
    + i`` for local rows ``i`` of segment ``s`` (``cu[s] .. cu[s + 1]``); ``per_row``
    [2, n] (k: global row, position)."""
    for s in range(cu.shape[0] - 1):
        row, position = seg_shift[0, s], seg_shift[1, s]
        for i in range(cu[s], cu[s + 1]):
            per_row[0, i] = row + i
            per_row[1, i] = position + i


def freeze(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.setflags(write=False)


def _as_lengths(values: object, what: str) -> np.ndarray:
    """A 1-D int64 copy of ``values``; rejects non-integer input instead of truncating."""
    arr = np.array(values)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D sequence of integers, got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind != "i" and kind != "u":
        if arr.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype} ({values!r})")
    if arr.dtype != np.int64:
        arr = arr.astype(np.int64)
    return arr


def _is_int64_vector(a: np.ndarray) -> bool:
    return a.dtype == np.int64 and a.ndim == 1


def validate_cp_size(cp_size: object) -> int:
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise ValueError(f"cp_size must be an integer >= 1, got {cp_size!r}")
    return int(cp_size)


def validate_lengths(
    extend_lens: IntArrayLike, prefix_lens: IntArrayLike | None
) -> tuple[np.ndarray, np.ndarray, int]:
    """Check one batch's lengths; return them as fresh read-only int64 arrays, and
    the smallest extend length (which the checks find anyway; layouts branch on it).

    Raises ValueError naming the bad request index and value.
    """
    if type(extend_lens) is list and (prefix_lens is None or type(prefix_lens) is list):
        # fast path for the common case (Python lists): one conversion for both
        num = len(extend_lens)
        if prefix_lens is None or len(prefix_lens) == num:
            buf = np.array(extend_lens if prefix_lens is None else extend_lens + prefix_lens)
            if num and buf.ndim == 1 and buf.dtype == np.int64:
                least = min(extend_lens)
                if least >= 1 and (prefix_lens is None or min(prefix_lens) >= 0):
                    if prefix_lens is None:
                        ext, pre = buf, np.zeros(num, dtype=np.int64)
                        freeze(ext, pre)
                    else:
                        buf.setflags(write=False)
                        ext, pre = buf[:num], buf[num:]
                    return ext, pre, least
        # otherwise fall through to the checks below, which name the problem
    elif type(extend_lens) is np.ndarray and _is_int64_vector(extend_lens) and (
        prefix_lens is None
        or (type(prefix_lens) is np.ndarray and _is_int64_vector(prefix_lens)
            and prefix_lens.shape == extend_lens.shape)
    ):
        # fast path for int64 vectors (what the engine passes): one copy for both
        num = extend_lens.shape[0]
        least = min(extend_lens.tolist()) if num else 0
        if least >= 1 and (prefix_lens is None or min(prefix_lens.tolist()) >= 0):
            buf = np.zeros(2 * num, dtype=np.int64)
            buf[:num] = extend_lens
            if prefix_lens is not None:
                buf[num:] = prefix_lens
            buf.setflags(write=False)
            return buf[:num], buf[num:], least
    ext = _as_lengths(extend_lens, "extend_lens")
    num = ext.shape[0]
    if num == 0:
        raise ValueError("empty batch: extend_lens must list at least one request")
    if prefix_lens is None:
        pre = np.zeros(num, dtype=np.int64)
    else:
        pre = _as_lengths(prefix_lens, "prefix_lens")
        if pre.shape[0] != num:
            raise ValueError(
                f"prefix_lens has {pre.shape[0]} entries but extend_lens has {num} requests; "
                "expected one prefix length per request"
            )
    if np.minimum.reduce(ext) < 1:
        j = int(np.flatnonzero(ext < 1)[0])
        raise ValueError(
            f"extend_lens[{j}] = {int(ext[j])}: every request needs at least 1 new token"
        )
    if num and np.minimum.reduce(pre) < 0:
        j = int(np.flatnonzero(pre < 0)[0])
        raise ValueError(f"prefix_lens[{j}] = {int(pre[j])}: prefix lengths must be >= 0")
    freeze(ext, pre)
    return ext, pre, int(np.minimum.reduce(ext))


# --------------------------------------------------------------------------- RankPlan


def _ro(name: str, doc: str) -> property:
    return property(attrgetter("_" + name), doc=doc)


class RankPlan:
    """What one rank needs for one batch: its rows in local order and its segments.

    ``rows``, ``positions`` and ``row_request`` have one entry per local row
    (unpadded). Segments are contiguous runs of local rows: segment ``s`` covers
    local rows ``cu_seqlens_q[s] .. cu_seqlens_q[s + 1]``, attends request
    ``seg_request[s]`` and sees ``seg_kv_len[s]`` keys at its last row (bottom-right
    causal alignment, prefix included). A segment's rows are consecutive rows of
    its request, so ``seg_shift`` [2, S] (global row - local index, position -
    local index, per segment) describes every row: a layout gives it, and the
    per-row arrays when it has them (else they are expanded on first use, as
    ``row_request`` is derived). Segments may be empty (``q_len == 0``): zigzag keeps
    their number static at ``2 * num_requests``; kernels skip them. Attributes are
    read-only and so are the arrays (non-writeable flags).
    """

    __slots__ = (
        "_rank",
        "_rows",
        "_positions",
        "_row_request",
        "_seg_request",
        "_seg_q_len",
        "_seg_kv_len",
        "_cu_seqlens_q",
        "_seg_shift",
        "_most",
    )

    # read-only views of the slots (no setters)
    rank: int = _ro("rank", "this rank's index in the CP group")  # type: ignore[assignment]
    seg_request: np.ndarray = _ro(  # type: ignore[assignment]
        "seg_request", "int64 [S]: request of each segment"
    )
    seg_q_len: np.ndarray = _ro(  # type: ignore[assignment]
        "seg_q_len", "int64 [S]: query rows of each segment"
    )
    seg_kv_len: np.ndarray = _ro(  # type: ignore[assignment]
        "seg_kv_len", "int64 [S]: keys visible to each segment's last row (prefix included)"
    )
    cu_seqlens_q: np.ndarray = _ro(  # type: ignore[assignment]
        "cu_seqlens_q", "int32 [S + 1]: offset of each segment's first row in local order"
    )

    def __init__(
        self,
        rank: int,
        seg_request: np.ndarray,
        seg_q_len: np.ndarray,
        seg_kv_len: np.ndarray,
        cu_seqlens_q: np.ndarray,
        seg_shift: np.ndarray,
        rows: np.ndarray | None = None,
        positions: np.ndarray | None = None,
        row_request: np.ndarray | None = None,
        most: Sequence[int] | None = None,
    ) -> None:
        """``most``: the largest q_len and kv_len of the segments, when the layout knows
        them (else found on first use)."""
        self._rank = rank
        self._seg_request = seg_request
        self._seg_q_len = seg_q_len
        self._seg_kv_len = seg_kv_len
        self._cu_seqlens_q = cu_seqlens_q
        self._seg_shift = seg_shift
        self._rows = rows
        self._positions = positions
        self._row_request = row_request
        self._most = most

    @property
    def max_lens(self) -> Sequence[int]:
        """``(max q_len, max kv_len)`` of the segments (0, 0 when there are none)."""
        most = self._most
        if most is None:
            q, kv = self._seg_q_len, self._seg_kv_len
            most = self._most = (int(q.max(initial=0)), int(kv.max(initial=0)))
        return most

    @property
    def rows(self) -> np.ndarray:
        """int64 [n]: global row of each local row."""
        if self._rows is None:
            self._expand()
        return self._rows

    @property
    def positions(self) -> np.ndarray:
        """int64 [n]: absolute position of each local row (prefix + offset)."""
        if self._positions is None:
            self._expand()
        return self._positions

    def _expand(self) -> None:
        per_row = np.empty((2, self.num_rows), dtype=np.int64)
        expand_runs(self._seg_shift, self._cu_seqlens_q, per_row)
        per_row.setflags(write=False)
        self._rows, self._positions = per_row[0], per_row[1]

    @property
    def seg_shift(self) -> np.ndarray:
        """int64 [2, S]: per segment, global row - local index and position - local
        index (the same for every row of the segment: its rows are consecutive rows of
        its request; any value for an empty segment)."""
        return self._seg_shift

    @property
    def row_request(self) -> np.ndarray:
        """int64 [n]: request of each local row (derived from the segments on first use)."""
        out = self._row_request
        if out is None:
            out = self._row_request = self._seg_request.repeat(self._seg_q_len)
            out.setflags(write=False)
        return out

    @property
    def num_rows(self) -> int:
        return int(self._cu_seqlens_q[-1])  # (not the rows': they may not be expanded)

    @property
    def num_segments(self) -> int:
        return int(self.seg_q_len.shape[0])

    @property
    def segments(self) -> list[tuple[int, int, int]]:
        """``(request_index, q_len, kv_len)`` per segment, as Python ints."""
        return list(
            zip(self.seg_request.tolist(), self.seg_q_len.tolist(), self.seg_kv_len.tolist())
        )

    def __repr__(self) -> str:
        return (
            f"RankPlan(rank={self.rank}, num_rows={self.num_rows}, "
            f"num_segments={self.num_segments})"
        )


# --------------------------------------------------------------------------- Plan


class Plan(ABC):
    """A layout's output for one batch; the same on every rank.

    Public attributes are read-only (arrays are flagged non-writeable):

    * ``cp_size``, ``num_requests`` (R), ``num_tokens`` (T = sum of extend lengths)
    * ``extend_lens``, ``prefix_lens`` (int64 [R]), ``cu_extend`` (int64 [R + 1])
    * ``local_rows`` (list of C ints, unpadded), ``max_local_rows``
    * per global row (int64 [T], computed on first use): ``token_request``,
      ``token_position``, ``owner``, ``local_index``
    * per request (int64 [R]): ``last_owner``, ``last_local_index`` -- where each
      request's last new token (the one whose logits are sampled) lives
    * ``rank(r)`` -> :class:`RankPlan` (cached), ``gather_index(capacity)``,
      ``padded_rows(align)``

    Subclasses implement :meth:`_build_rank`, ``owner``, ``local_index``,
    ``last_owner``, ``last_local_index`` and set ``local_rows`` in ``__init__``.
    """

    #: layout name ("zigzag", "interleave", ...)
    layout_name: str = ""

    cp_size: int
    extend_lens: np.ndarray
    prefix_lens: np.ndarray
    num_requests: int
    num_tokens: int
    local_rows: list[int]
    max_local_rows: int

    def __init__(
        self, cp_size: int, extend_lens: np.ndarray, prefix_lens: np.ndarray, num_tokens: int
    ) -> None:
        """Takes read-only lengths from :func:`validate_lengths` (use ``Layout.plan``)
        and their sum, which every layout computes on its way anyway."""
        d = self.__dict__
        d["cp_size"] = cp_size
        d["extend_lens"] = extend_lens
        d["prefix_lens"] = prefix_lens
        d["num_requests"] = extend_lens.shape[0]
        d["num_tokens"] = num_tokens
        d["_ranks"] = [None] * cp_size

    @cached_property
    def cu_extend(self) -> np.ndarray:  # type: ignore[override]
        """int64 [R + 1]: offset of each request's first global row."""
        cu = np.zeros(self.num_requests + 1, dtype=np.int64)
        np.add.accumulate(self.extend_lens, out=cu[1:])
        freeze(cu)
        return cu

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Plan is read-only; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Plan is read-only; cannot delete {name!r}")

    def _set_local_rows(self, local_rows: list[int]) -> None:
        self.__dict__["local_rows"] = local_rows
        self.__dict__["max_local_rows"] = max(local_rows)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(cp_size={self.cp_size}, num_requests={self.num_requests}, "
            f"num_tokens={self.num_tokens}, local_rows={self.local_rows})"
        )

    # ----------------------------------------------------------------- per rank

    def rank(self, r: int) -> RankPlan:
        """Rank ``r``'s rows and segments (computed on first use, then cached)."""
        if type(r) is not int:
            if isinstance(r, bool) or not isinstance(r, np.integer):
                raise ValueError(f"rank must be an integer in [0, {self.cp_size}), got {r!r}")
            r = int(r)
        if not 0 <= r < self.cp_size:
            raise ValueError(f"rank must be an integer in [0, {self.cp_size}), got {r!r}")
        ranks = self._ranks  # type: ignore[attr-defined]
        rp = ranks[r]
        if rp is None:
            rp = ranks[r] = self._build_rank(r)
        return rp

    def ranks(self) -> list[RankPlan]:
        """Every rank's plan, in rank order."""
        return [self.rank(r) for r in range(self.cp_size)]

    @abstractmethod
    def _build_rank(self, r: int) -> RankPlan:
        """Build rank ``r``'s plan (``0 <= r < cp_size``, already checked)."""

    # ----------------------------------------------------------------- global maps

    @cached_property
    def token_request(self) -> np.ndarray:
        """int64 [T]: request index of each global row."""
        out = np.repeat(arange(self.num_requests), self.extend_lens)
        freeze(out)
        return out

    @cached_property
    def token_position(self) -> np.ndarray:
        """int64 [T]: absolute position of each global row (prefix + offset in request)."""
        shift = self.prefix_lens - self.cu_extend[:-1]
        out = np.repeat(shift, self.extend_lens)
        out += arange(self.num_tokens)
        freeze(out)
        return out

    @property
    @abstractmethod
    def owner(self) -> np.ndarray:
        """int64 [T]: the rank owning each global row."""

    @property
    @abstractmethod
    def local_index(self) -> np.ndarray:
        """int64 [T]: index of each global row in its owner's local order."""

    @property
    @abstractmethod
    def last_owner(self) -> np.ndarray:
        """int64 [R]: the rank owning each request's last new token."""

    @property
    @abstractmethod
    def last_local_index(self) -> np.ndarray:
        """int64 [R]: local index of each request's last new token on its owner."""

    # ----------------------------------------------------------------- gather / padding

    def _check_capacity(self, capacity: int) -> int:
        if type(capacity) is int and capacity >= self.max_local_rows:
            return capacity
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise ValueError(f"capacity must be an integer, got {capacity!r}")
        if capacity < self.max_local_rows:
            raise ValueError(
                f"capacity {capacity} is smaller than the largest rank's local rows "
                f"({self.max_local_rows}); expected capacity >= max_local_rows"
            )
        return int(capacity)

    def gather_index(self, capacity: int) -> np.ndarray:
        """int64 [T]: where global row ``g`` lands after a rank-major all-gather of
        every rank's local rows padded to ``capacity``: ``owner * capacity + local_index``.

        ``gathered[plan.gather_index(cap)]`` restores global (batch) order.
        """
        cap = self._check_capacity(capacity)
        out = self.owner * cap
        out += self.local_index
        return out

    def padded_rows(self, align: int) -> int:
        """``max_local_rows`` rounded up to a multiple of ``align``."""
        if type(align) is int and align >= 1:
            return -(-self.max_local_rows // align) * align
        if isinstance(align, bool) or not isinstance(align, (int, np.integer)) or align < 1:
            raise ValueError(f"align must be an integer >= 1, got {align!r}")
        return -(-self.max_local_rows // int(align)) * int(align)


# --------------------------------------------------------------------------- Layout


class Layout(ABC):
    """A CP layout strategy: ``plan(extend_lens, prefix_lens)`` -> :class:`Plan`."""

    name: str = ""

    def __init__(self, cp_size: int) -> None:
        self._cp_size = validate_cp_size(cp_size)

    @property
    def cp_size(self) -> int:
        return self._cp_size

    def plan(self, extend_lens: IntArrayLike, prefix_lens: IntArrayLike | None = None) -> Plan:
        """Plan one batch. ``prefix_lens`` defaults to zeros (no cached prefix).

        Raises ValueError for an empty batch, an extend length < 1, a negative
        prefix length or mismatched lengths, naming the bad request and value.
        """
        ext, pre, least = validate_lengths(extend_lens, prefix_lens)
        return self._plan(ext, pre, least)

    def plan_checked(self, extend_lens: np.ndarray, prefix_lens: np.ndarray, min_extend: int) -> Plan:
        """:meth:`plan` of lengths the caller has checked (the batch preparer's hot path:
        no checks, no copy): read-only int64 [R] arrays, R >= 1, every extend length
        >= 1 (``min_extend``, the smallest), every prefix length >= 0. The plan keeps them."""
        return self._plan(extend_lens, prefix_lens, min_extend)

    @abstractmethod
    def _plan(self, extend_lens: np.ndarray, prefix_lens: np.ndarray, min_extend: int) -> Plan:
        """Build the plan from validated int64 lengths (``min_extend``: the smallest)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cp_size={self.cp_size})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return type(other) is type(self) and other.cp_size == self.cp_size

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.cp_size))


# --------------------------------------------------------------------------- metrics


def causal_work_per_rank(plan: Plan) -> np.ndarray:
    """int64 [C]: causal attention work of each rank, i.e. the number of visible
    (query, key) pairs summed over its segments (= sum over its rows of position + 1).

    ``max / mean`` of this is the layout's load imbalance.
    """
    work = np.zeros(plan.cp_size, dtype=np.int64)
    for r in range(plan.cp_size):
        rp = plan.rank(r)
        q = rp.seg_q_len
        # rows of a segment see kv-q+1 .. kv keys: sum = q*(kv-q) + q*(q+1)/2
        work[r] = int(np.sum(q * (rp.seg_kv_len - q) + q * (q + 1) // 2))
    return work
