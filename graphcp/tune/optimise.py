"""Choose bucket capacities that minimise the expected cost of a workload, exactly.

Cost model (row-equivalents, per batch; ``r`` = the largest rank's raw local rows,
the number ``BucketSet.select`` receives):

- graph replay on capacity c: ``c`` (every padded row is computed);
- eager (no bucket >= r, or the chosen one has ``c > padding_factor * r``):
  ``eager_penalty * r``. The default penalty is the padding factor itself: the
  factor is the operator's statement that a graph padded more than F x is no
  better than running eagerly, so eager is priced like the worst graph the rule
  allows (worse than any moderately padded graph). The factor compares against the
  RAW rows, exactly as ``BucketSet.select`` does.
- optional ``bucket_cost``: every bucket adds this many row-equivalents to the MEAN
  cost per batch. Captures share one memory pool (sized by the largest bucket), so
  an extra bucket mostly costs capture time, about the same for every capacity;
  a constant price per bucket is that first-order model.

The penalty must be >= the factor. A smaller one contradicts the runner's rule: it
would send batches to graphs padded up to F x that the model calls worse than
eager (lower the factor to the penalty instead). With penalty >= F one more bucket
never costs rows, so "exactly k" and "at most k" agree and the curve only falls.

Exactness. Only the aligned required values are candidates: any bucket can be
lowered to the largest aligned requirement it serves without losing a batch, and
lowering only reduces padding and can only turn an eager batch into a graph one.
Sorted candidates a_1 < ... < a_V split the batches into runs; the DP
``f[k][j] = min_{i<j} f[k-1][i] + seg(i, j)`` over "a_j is the k-th smallest bucket"
is exact, and the tail past the largest bucket runs eagerly. ``seg`` is O(1) from
prefix sums over the histogram of distinct required values; split by whether the
previous bucket ends before the eager threshold of a_j, each k is a prefix minimum
plus a banded (V x V) minimum, vectorised in column blocks: O(K V^2) cheap cells.
The curve for every k <= K comes from the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphcp.errors import InputError
from graphcp.runtime.capture.buckets import DEFAULT_PADDING_FACTOR, align_up
from graphcp.tune.settings import check_costs, check_search

#: the banded (V x V) minimum runs a column block of about this many cells at a time
_COLUMN_BLOCK_ELEMS = 1 << 20


@dataclass(frozen=True)
class CostModel:
    padding_factor: float = DEFAULT_PADDING_FACTOR
    eager_penalty: float | None = None  # None: the padding factor (see module doc)
    bucket_cost: float = 0.0  # row-equivalents per batch, per bucket

    def __post_init__(self) -> None:
        check_costs(self.padding_factor, self.eager_penalty, self.bucket_cost)

    @property
    def penalty(self) -> float:
        return self.padding_factor if self.eager_penalty is None else float(self.eager_penalty)


@dataclass(frozen=True)
class ParetoPoint:
    k: int  # number of buckets
    capacities: tuple[int, ...]
    cost: float  # total row-equivalents over the workload (without the bucket cost)


@dataclass(frozen=True)
class TuneResult:
    capacities: tuple[int, ...]  # the chosen set (empty when no batch fits max_capacity)
    cost: float  # total row-equivalents of the chosen set
    n_batches: int
    real_rows: int  # sum of raw required rows
    candidates: int  # V: distinct aligned required values within max_capacity
    pareto: list[ParetoPoint] = field(default_factory=list)  # best set of k buckets, k = 1..min(K, V)
    align: int = 8
    max_capacity: int | None = None
    model: CostModel = CostModel()

    def best(self, k: int) -> ParetoPoint:
        """Best set with at most k buckets (k past the candidates: all of them, the optimum)."""
        if not self.pareto:
            raise ValueError("no candidate capacity: every batch exceeds max_capacity")
        return self.pareto[min(k, len(self.pareto)) - 1]


def optimise(
    required: np.ndarray,
    max_buckets: int,
    align: int = 8,
    max_capacity: int | None = None,
    model: CostModel = CostModel(),
) -> TuneResult:
    """At most ``max_buckets`` capacities minimising total cost (+ bucket_cost x k)."""
    required = np.asarray(required, dtype=np.int64)
    check_search(max_buckets, align, max_capacity)
    if required.size == 0:
        raise InputError("no batches to tune for")
    if required.min() < 1:
        raise InputError(f"required rows must be >= 1, got {int(required.min())}")
    # round down: capacities are multiples of align
    cap = None if max_capacity is None else (int(max_capacity) // align) * align

    pen = model.penalty
    vals, counts = np.unique(required, return_counts=True)
    n_cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.float64)
    r_cum = np.concatenate([[0], np.cumsum(vals * counts)]).astype(np.float64)
    u = len(vals)
    cands = np.unique(align_up(vals, align))
    if cap is not None:
        cands = cands[cands <= cap]
    v = len(cands)
    common = dict(
        n_batches=int(required.size), real_rows=int(r_cum[-1]), candidates=v, align=align, max_capacity=cap, model=model
    )
    if v == 0:
        return TuneResult((), float(pen * r_cum[-1]), **common)

    a = cands.astype(np.float64)
    # p[j]: distinct raw values <= a_j (the batches a_j can hold)
    p = np.searchsorted(vals, cands, side="right")
    # m[j]: distinct raw values too small for a_j: a_j > F * r (select's float test)
    m = np.searchsorted(model.padding_factor * vals, cands, side="left")
    tail = pen * (r_cum[u] - r_cum[p])  # batches above a_j run eagerly

    # Rows of the DP are "the previous bucket": row 0 none, row i >= 1 candidate i-1;
    # a_j may follow rows 0..j. The batches a_j serves are raw indices [p_lo[i], p[j]):
    # those below m[j] run eagerly (pen * r), the rest cost a_j each. Two regimes:
    #   A, p_lo[i] <= m[j]: seg = pen*(R[m] - R[p_lo[i]]) + a_j*(N[p] - N[m])
    #      -> a prefix minimum over i of f[i] - pen*R[p_lo[i]], O(V) per k;
    #   B, p_lo[i] >  m[j]: seg = a_j*(N[p] - N[p_lo[i]])
    #      -> min over rows qa[j]..j of f[i] - a_j*N[p_lo[i]], a banded (V x V) minimum.
    p_lo = np.concatenate([[0], p])
    n_lo, r_lo = n_cum[p_lo], r_cum[p_lo]
    cols = np.arange(v)
    qa = np.minimum(np.searchsorted(p_lo, m, side="right"), cols + 1)  # first regime-B row
    const_a = pen * r_cum[m] + a * (n_cum[p] - n_cum[m])
    const_b = a * n_cum[p]
    block = max(1, _COLUMN_BLOCK_ELEMS // (v + 1))

    k_max = min(max_buckets, v)
    f = np.full(v + 1, np.inf)
    f[0] = 0.0  # zero buckets so far, nothing served
    rows_all = np.arange(v + 1)
    parents = []
    totals = []
    for _ in range(k_max):
        g = f - pen * r_lo
        pre_min = np.minimum.accumulate(g)
        pre_arg = np.maximum.accumulate(np.where(g == pre_min, rows_all, 0))
        best = pre_min[qa - 1] + const_a
        par = pre_arg[qa - 1]
        for j0 in range(0, v, block):
            j1 = min(v, j0 + block)
            lo = int(qa[j0])  # qa only grows with j
            if lo > j1 - 1:
                continue
            rows = rows_all[lo:j1]
            tot = f[lo:j1, None] - n_lo[lo:j1, None] * a[None, j0:j1]
            band = (rows[:, None] < qa[None, j0:j1]) | (rows[:, None] > cols[None, j0:j1])
            tot[band] = np.inf
            arg = np.argmin(tot, axis=0)
            val = tot[arg, np.arange(j1 - j0)] + const_b[j0:j1]
            take = val < best[j0:j1]
            best[j0:j1] = np.where(take, val, best[j0:j1])
            par[j0:j1] = np.where(take, arg + lo, par[j0:j1])
        f = np.concatenate([[np.inf], best])  # from now on at least one bucket
        parents.append(np.concatenate([[0], par]))
        end = f[1:] + tail
        j = int(np.argmin(end))
        totals.append((float(end[j]), j + 1))

    pareto: list[ParetoPoint] = []
    for k, (cost, j) in enumerate(totals, start=1):
        caps = []
        for par in reversed(parents[:k]):
            caps.append(int(cands[j - 1]))
            j = int(par[j])
        pareto.append(ParetoPoint(k, tuple(sorted(caps)), cost))

    # smallest k on ties: a bucket that saves nothing is not worth capturing
    n = required.size
    scores = [pt.cost / n + model.bucket_cost * len(pt.capacities) for pt in pareto]
    low = min(scores)
    pick = next(i for i, s in enumerate(scores) if s <= low + 1e-9 * max(1.0, abs(low)))
    return TuneResult(pareto[pick].capacities, pareto[pick].cost, pareto=pareto, **common)
