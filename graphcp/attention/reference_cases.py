"""Attention backends against the torch reference: the one harness the tests and the
GPU check (:mod:`graphcp.gpucheck.kernels`) share.

- **Plans**: one rank's segments for a batch, built by hand for the zigzag and
  interleave layouts (written apart from :mod:`graphcp.cp` on purpose, so the two
  check each other: ``tests/test_reference_cases.py``), with cached prefixes and the
  empty segments of requests shorter than 2C; random plans for the GPU check.
- **Paged inputs**: metadata over a page pool (pages in request order, or scattered
  by an rng), optionally padded with empty segments as a full graph's static
  metadata is; random ``q`` and KV cache; ``out``/``lse`` filled with
  :data:`SENTINEL`.
- **The reference**: :class:`TorchAttention` in float32 (no TF32 on a GPU when the
  caller sets ``torch.set_float32_matmul_precision("highest")``) on the same,
  rounded inputs; LSE in base e (the contract, :mod:`graphcp.attention.base`).
- **The comparison**: ``max |x - ref| / max |ref|`` per dtype tolerance
  (:data:`TOLERANCE`; LSE against ``max(max |ref|, 1)``), and the padding rows past
  the live ones must still hold the sentinel.
- **Decode cases** (:func:`decode_case`): a decode bucket's rows (one query row a
  request, lengths mixed, some 0: a rank that holds none of a request, and the bucket's
  padding rows) over a page table wider than the longest needs (a page bucket), as its
  static device buffers and as the step's live metadata; the reference is the same torch
  attention over the live metadata, and every row is compared (a row with no key: output
  0 and LSE -inf, exactly).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from graphcp.attention.backends.torch_ref import TorchAttention
from graphcp.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec
from graphcp.kv.layout import KVLayout

#: what ``out``/``lse`` are filled with first: exact in every dtype, so padding rows must still equal it
SENTINEL = -1024.0
#: max |x - ref| / max |ref| a backend may show (bf16 as tests/test_hf_parity.py: output rounding)
TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
#: denominators' floors: outputs near zero everywhere, LSE near zero (one visible key)
OUT_FLOOR, LSE_FLOOR = 1e-6, 1.0
#: a case's metadata is padded to this many segments, as a full graph's static metadata is
SEGMENT_SLOTS = 16
#: query rows past the live ones in a case: they must stay untouched
PAD_ROWS = 5


# ---- plans -----------------------------------------------------------------------------
@dataclass(frozen=True)
class SegmentPlan:
    """One rank's segments: query rows, keys seen by the last row (prefix included)
    and request of each, plus each request's total tokens (prefix + new)."""

    q_lens: list[int]
    kv_lens: list[int]
    seg_request: list[int]
    request_tokens: list[int]

    @property
    def num_rows(self) -> int:
        return sum(self.q_lens)


def zigzag_plan(extend: list[int], prefix: list[int], cp: int, rank: int) -> SegmentPlan:
    """Rank ``rank``'s segments: early block r and late block 2C-1-r of every request
    (2C blocks, the first ``n % 2C`` one token longer; empty when the request is short)."""
    q_lens, kv_lens, seg_request = [], [], []
    for j, (n, p) in enumerate(zip(extend, prefix)):
        base, rem = divmod(n, 2 * cp)
        blocks = [base + (b < rem) for b in range(2 * cp)]
        for b in (rank, 2 * cp - 1 - rank):
            q_lens.append(blocks[b])
            kv_lens.append(p + sum(blocks[: b + 1]))
            seg_request.append(j)
    return SegmentPlan(q_lens, kv_lens, seg_request, [p + n for n, p in zip(extend, prefix)])


def interleave_plan(extend: list[int], prefix: list[int], cp: int, rank: int) -> SegmentPlan:
    """Rank ``rank`` owns flattened rows rank, rank + C, ...; each is a one-row segment."""
    q_lens, kv_lens, seg_request = [], [], []
    flat = [(j, t) for j, n in enumerate(extend) for t in range(n)]
    for j, t in flat[rank::cp]:
        q_lens.append(1)
        kv_lens.append(prefix[j] + t + 1)
        seg_request.append(j)
    return SegmentPlan(q_lens, kv_lens, seg_request, [p + n for n, p in zip(extend, prefix)])


PLANNERS = {"zigzag": zigzag_plan, "interleave": interleave_plan}


@dataclass(frozen=True)
class RankBatch:
    """A batch as one rank of a CP group sees it: what a plan is made from."""

    layout: str
    cp: int
    rank: int
    extend: list[int]
    prefix: list[int]

    def plan(self) -> SegmentPlan:
        return PLANNERS[self.layout](self.extend, self.prefix, self.cp, self.rank)

    def label(self) -> str:
        return f"{self.layout} cp={self.cp} rank={self.rank} extend={self.extend} prefix={self.prefix}"


def edge_and_random_batches(rng: np.random.Generator, count: int, max_extend: int,
                            max_prefix: int) -> list[RankBatch]:
    """Two fixed edge cases (one long request with a prefix at C = 1; requests shorter
    than 2C, so empty segments, at C = 4), then ``count`` random zigzag batches
    (C in 1, 2, 4, 8; 1-4 requests; a prefix on 70% of them)."""
    big, pre = max_extend, max_prefix
    batches = [
        RankBatch("zigzag", 1, 0, [big], [pre // 2]),
        RankBatch("zigzag", 4, 3, [3, 1, big // 2, 7], [0, pre, 5, 0]),
    ]
    for _ in range(count):
        cp = int(rng.choice([1, 2, 4, 8]))
        n = int(rng.integers(1, 5))
        extend = [int(x) for x in rng.integers(1, big + 1, n)]
        prefix = [int(x) if rng.random() < 0.7 else 0 for x in rng.integers(0, pre + 1, n)]
        batches.append(RankBatch("zigzag", cp, int(rng.integers(cp)), extend, prefix))
    return batches


# ---- paged inputs ----------------------------------------------------------------------
def paged_metadata(plan: SegmentPlan, page_size: int, device: torch.device | str = "cpu", *,
                   width: int | None = None, slots: int | None = None, rng: np.random.Generator | None = None,
                   spare_pages: int = 0) -> tuple[AttentionMetadata, int]:
    """Metadata of ``plan`` over a page pool; returns it and the pool's page count.

    Page 0 is the scratch page. Without ``rng`` request j owns the next pages in
    request order from page 1; with it, pages are drawn from a shuffled pool of
    ``spare_pages`` more than needed. ``width``: page-table columns (default: the
    longest request's pages + 1, so entries past a request's pages are 0).
    ``slots``: pad to that many segments with empty ones, as a full graph's
    static metadata is."""
    need = [-(-t // page_size) for t in plan.request_tokens]
    total = sum(need)
    num_pages = total + 1 + spare_pages
    pool = np.arange(1, num_pages) if rng is None else rng.permutation(np.arange(1, num_pages))
    starts = np.concatenate([[0], np.cumsum(need)]).astype(np.int64)
    if width is None:
        width = max(need + [1]) + 1
    if max(need + [0]) > width:
        raise ValueError(f"a request needs {max(need)} pages, the page table has width={width}")
    segments = len(plan.q_lens)
    rows = slots if slots is not None else segments
    if rows < segments:
        raise ValueError(f"the plan has {segments} segments, more than slots={slots}")
    table = np.zeros((rows, width), np.int32)
    for s, j in enumerate(plan.seg_request):
        table[s, : need[j]] = pool[starts[j]: starts[j + 1]]
    cu = np.full(rows + 1, plan.num_rows, np.int32)  # padding segments: empty, after the live rows
    cu[: segments + 1] = np.concatenate([[0], np.cumsum(plan.q_lens)])
    kv_lens = np.zeros(rows, np.int32)
    kv_lens[:segments] = plan.kv_lens
    return AttentionMetadata.from_host(cu, kv_lens, table, page_size, device), num_pages


def kv_shape(spec: AttentionSpec, num_pages: int, layout: KVLayout | None = None) -> tuple[int, ...]:
    """``[pages, 2, page_size, Hkv, D]`` (NHD) or ``[pages, 2, Hkv, page_size, D]`` (HND)."""
    page = (spec.page_size, spec.num_kv_heads, spec.head_dim)
    if (layout or spec.kv_layout) == "HND":
        page = (spec.num_kv_heads, spec.page_size, spec.head_dim)
    return (num_pages, 2, *page)


def random_inputs(spec: AttentionSpec, rows: int, num_pages: int, dtype: torch.dtype, generator: torch.Generator,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``q [rows, Hq, D]`` and KV cache in ``spec``'s layout (drawn on the CPU: seeded the same anywhere)."""
    q = torch.randn(rows, spec.num_q_heads, spec.head_dim, generator=generator).to(dtype).to(device)
    kv = torch.randn(kv_shape(spec, num_pages), generator=generator).to(dtype).to(device)
    return q, kv


def sentinel_outputs(q: torch.Tensor, with_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out`` like ``q`` and float32 ``lse [rows, Hq]`` (or None), filled with :data:`SENTINEL`."""
    out = torch.full_like(q, SENTINEL)
    lse = torch.full(q.shape[:2], SENTINEL, dtype=torch.float32, device=q.device) if with_lse else None
    return out, lse


def tensors(spec: AttentionSpec, rows: int, num_pages: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
            device: torch.device | str = "cpu"):
    """Random ``q`` and KV cache, and ``out``/``lse`` filled with the sentinel."""
    q, kv = random_inputs(spec, rows, num_pages, dtype, torch.Generator().manual_seed(seed), device)
    return (q, kv, *sentinel_outputs(q))


# ---- the reference and the comparison ----------------------------------------------------
def reference(spec: AttentionSpec, q: torch.Tensor, kv: torch.Tensor,
              meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 torch attention of the live rows: output ``[rows, Hq, D]`` and base-e LSE ``[rows, Hq]``."""
    n = meta.num_q_rows
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
    TorchAttention(spec).forward(q.float(), kv.float(), meta, out, lse)
    return out[:n], lse[:n]


def rel_error(x: torch.Tensor, ref: torch.Tensor, floor: float) -> float:
    """``max |x - ref| / max(max |ref|, floor)``; a NaN or inf anywhere counts as inf (a failure)."""
    if ref.numel() == 0:
        return 0.0
    val = float((x.float() - ref.float()).abs().max() / max(float(ref.abs().max()), floor))
    return val if math.isfinite(val) else math.inf


@dataclass(frozen=True)
class Comparison:
    """One backend call against the reference."""

    out: float  # relative error of the output (live rows)
    lse: float | None  # relative error of the LSE (None: called without)
    padding_untouched: bool  # rows past the live ones kept the sentinel (out and lse)
    tol: float

    @property
    def ok(self) -> bool:
        return self.padding_untouched and max(self.out, self.lse or 0.0) <= self.tol

    def __str__(self) -> str:
        lse = "-" if self.lse is None else f"{self.lse:.2e}"
        return (f"out err {self.out:.2e}, lse err {lse} (tolerance {self.tol:g}); "
                f"padding rows {'untouched' if self.padding_untouched else 'WRITTEN'}")


def compare(out: torch.Tensor, lse: torch.Tensor | None, ref_out: torch.Tensor, ref_lse: torch.Tensor,
            dtype: torch.dtype) -> Comparison:
    """``out``/``lse`` (all rows, padding included) against the reference of the live rows."""
    n = ref_out.shape[0]
    padding = bool((out[n:].float() == SENTINEL).all())
    lse_err = None
    if lse is not None:
        lse_err = rel_error(lse[:n], ref_lse, LSE_FLOOR)
        padding &= bool((lse[n:] == SENTINEL).all())
    return Comparison(rel_error(out[:n], ref_out, OUT_FLOOR), lse_err, padding, TOLERANCE[dtype])


def against_reference(spec: AttentionSpec, q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata,
                      out: torch.Tensor, lse: torch.Tensor | None) -> Comparison:
    """A backend's ``out``/``lse`` for ``q`` over ``kv`` against the reference (tolerance of ``q``'s dtype)."""
    return compare(out, lse, *reference(spec, q, kv, meta), q.dtype)


# ---- a case: one plan's inputs and reference, shared by every backend --------------------
@dataclass
class Case:
    """Inputs of one plan in one dtype and their float32 reference. The KV cache is
    kept NHD; :meth:`kv` gives it in the layout a backend wants."""

    spec: AttentionSpec  # NHD
    meta: AttentionMetadata
    num_pages: int
    q: torch.Tensor  # [live rows + pad rows, Hq, D]
    kv_nhd: torch.Tensor
    ref_out: torch.Tensor  # float32 [live rows, Hq, D]
    ref_lse: torch.Tensor  # float32 [live rows, Hq]

    def kv(self, layout: KVLayout) -> torch.Tensor:
        return self.kv_nhd if layout == "NHD" else self.kv_nhd.transpose(2, 3).contiguous()


def build_case(plan: SegmentPlan, spec: AttentionSpec, dtype: torch.dtype, device: torch.device | str,
               generator: torch.Generator, rng: np.random.Generator, *, slots: int | None = None,
               pad_rows: int = PAD_ROWS, width: int | None = None) -> Case:
    """Random inputs for ``plan`` (pages scattered over a pool with spare pages) and their reference."""
    spec = dataclasses.replace(spec, kv_layout="NHD")
    meta, num_pages = paged_metadata(plan, spec.page_size, device, width=width, slots=slots, rng=rng,
                                     spare_pages=2 + len(plan.request_tokens))
    q, kv = random_inputs(spec, meta.num_q_rows + pad_rows, num_pages, dtype, generator, device)
    return Case(spec, meta, num_pages, q, kv, *reference(spec, q, kv, meta))


def run_on_case(backend: AttentionBackend, case: Case, with_lse: bool = True) -> Comparison:
    """``backend`` (prepared with the case's metadata) on the case, against its reference."""
    out, lse = sentinel_outputs(case.q, with_lse)
    backend.prepare(case.meta)
    backend.forward(case.q, case.kv(backend.spec.kv_layout), case.meta, out, lse)
    if case.q.device.type == "cuda":
        torch.cuda.synchronize(case.q.device)
    return compare(out, lse, case.ref_out, case.ref_lse, case.q.dtype)


# ---- decode cases: a decode bucket's rows, for the decode kernels (graphcp.attention.base.DecodeKernel) ----
@dataclass
class DecodeCase:
    """One decode step on a bucket: ``lens`` keys of each request (0: none on this rank),
    then the bucket's padding rows (0 keys), pages scattered over a pool. ``live``: the
    step's metadata (host arrays, what a kernel's host planning reads); ``static``: the
    bucket's device buffers (what a captured kernel reads). The KV cache is kept NHD."""

    spec: AttentionSpec  # NHD
    live: AttentionMetadata
    static: AttentionMetadata
    num_pages: int
    q: torch.Tensor  # [rows, Hq, D]
    kv_nhd: torch.Tensor
    ref_out: torch.Tensor  # float32 [rows, Hq, D]
    ref_lse: torch.Tensor  # float32 [rows, Hq]

    def kv(self, layout: KVLayout) -> torch.Tensor:
        return self.kv_nhd if layout == "NHD" else self.kv_nhd.transpose(2, 3).contiguous()

    @property
    def rows(self) -> int:
        return self.q.shape[0]


def decode_metadata(lens: list[int], rows: int, width: int, page_size: int, rng: np.random.Generator,
                    device: torch.device | str = "cpu", spare_pages: int = 3) -> tuple[AttentionMetadata,
                                                                                       AttentionMetadata, int]:
    """(live, static) metadata of a decode step of ``lens`` on a bucket of ``rows`` rows and
    ``width`` pages, and the pool's page count (page 0 the scratch page)."""
    need = [-(-n // page_size) for n in lens]
    if max(need + [0]) > width or len(lens) > rows:
        raise ValueError(f"lens {lens} do not fit a bucket of {rows} rows x {width} pages of {page_size}")
    num_pages = sum(need) + 1 + spare_pages
    pool = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((rows, width), np.int32)
    kv_lens = np.zeros(rows, np.int32)
    at = 0
    for j, (n, p) in enumerate(zip(lens, need)):
        table[j, :p], kv_lens[j] = pool[at: at + p], n
        at += p
    cu = np.arange(rows + 1, dtype=np.int32)
    live = AttentionMetadata.from_host(cu, kv_lens, table, page_size, device, causal=False)
    bufs = tuple(torch.from_numpy(a.copy()).to(device) for a in (cu, kv_lens, table))
    static = AttentionMetadata(np.zeros(rows + 1, np.int32), np.zeros(rows, np.int32),
                               np.zeros((rows, width), np.int32), page_size, 1, width * page_size, device,
                               device_tensors=bufs)
    return live, static, num_pages


def decode_case(lens: list[int], spec: AttentionSpec, dtype: torch.dtype, device: torch.device | str,
                generator: torch.Generator, rng: np.random.Generator, *, rows: int | None = None,
                width: int | None = None) -> DecodeCase:
    """Random inputs of a decode step of ``lens`` (the bucket: ``rows`` rows, default the
    next power of two; ``width`` pages, default twice the longest request's) and their
    float32 torch reference."""
    spec = dataclasses.replace(spec, kv_layout="NHD")
    rows = rows or 1 << (len(lens) - 1).bit_length()
    width = width or 2 * max(1, max(-(-n // spec.page_size) for n in lens))
    live, static, num_pages = decode_metadata(lens, rows, width, spec.page_size, rng, device)
    q, kv = random_inputs(spec, rows, num_pages, dtype, generator, device)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
    TorchAttention(spec).forward(q.float(), kv.float(), live, out, lse)
    return DecodeCase(spec, live, static, num_pages, q, kv, out, lse)


def compare_decode(out: torch.Tensor, lse: torch.Tensor | None, case: DecodeCase) -> Comparison:
    """Every row of the bucket against the reference: rows with no key (the bucket's
    padding rows among them) must be exactly output 0 and LSE -inf, what the Comparison's
    ``padding_untouched`` reports here; the others within the dtype's tolerance."""
    empty = torch.from_numpy(case.live.kv_lens_host == 0).to(out.device)
    exact = bool((out[empty] == 0).all())
    lse_err = None
    if lse is not None:
        exact &= bool(torch.isneginf(lse[empty]).all()) and bool(torch.isfinite(lse[~empty]).all())
        lse_err = rel_error(lse[~empty], case.ref_lse[~empty], LSE_FLOOR)
    return Comparison(rel_error(out, case.ref_out, OUT_FLOOR), lse_err, exact, TOLERANCE[case.q.dtype])


def run_decode_case(kernel: AttentionBackend, case: DecodeCase, with_lse: bool = True) -> Comparison:
    """A decode kernel on the case's bucket (planned with the step's live metadata, run on
    the static buffers, as a decode graph does), against its reference."""
    out, lse = sentinel_outputs(case.q, with_lse)
    kernel.bucket(case.rows)
    kernel.prepare(case.live)
    kernel.forward(case.q, case.kv(kernel.spec.kv_layout), case.static, out, lse)
    if case.q.device.type == "cuda":
        torch.cuda.synchronize(case.q.device)
    return compare_decode(out, lse, case)
