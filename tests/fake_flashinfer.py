"""Fakes of FlashInfer's paged prefill wrapper and of trtllm-gen's context FMHA
that behave like the real kernels where graphcp depends on them (no GPU, no
flashinfer install; the real kernels are never called).

What they model, read in flashinfer-python 0.7.4 (``prefill.py``, ``csrc/`` and
the headers under ``data/include``):

- **Launches as graph nodes.** Each kernel is one registered op
  (``graphcp_fake::...``) over tensors plus frozen host integers, so the CPU
  ``trace`` graph backend records and replays it the way a CUDA graph holds a
  kernel node: tensor contents are read at replay, host integers stay as captured.
- **Attention itself**, in float32 from the library's own representation
  (``qo_indptr``/``paged_kv_indptr``/indices/last-page lengths for the wrapper,
  block tables and ``cum_seq_lens_q`` for trtllm-gen), bottom-right causal, or
  with ``causal=False`` every row over all its keys (what ring steps plan); LSE
  in base 2 (``max + log2(sum(exp2(...)))``, FlashInfer's convention; trtllm-gen's
  ``ComputeLSEFromMD`` writes ``log2e * m + log2(d)``, also base 2). A row that
  sees no key gets output 0 and LSE -inf.
- **Wrapper backends.** ``backend="auto"`` resolves at the first plan and is kept
  in CUDA-graph mode: FA3 on SM90 when a query is longer than 64 rows, FA2
  otherwise. FA2 reads every row count from the device buffers the latest plan
  wrote (``total_num_rows`` and the tile schedule live in the int workspace).
  FA3 bakes ``q.size(0)`` into its TMA descriptor at the call
  (``params.nnz_qo = q.size(0)`` in ``batch_prefill_sm90.cu``): a replay reads no
  row past the extent the call had, and a zero extent fails to initialise the
  descriptor (recorded in ``Recorder.errors``; the real one prints a CUDA error).
- **FA2's plan workspace** in CUDA-graph mode (``PrefillSplitQOKVIndptr`` and
  ``PrefillPlanImpl`` in ``attention/scheduler.cuh``, ``AlignedAllocator`` in
  ``allocator.h``): the tile size from the longest possible query
  (``FA2DetermineCtaTileQ``), the grid padded to ``max(2 x SMs / kv heads,
  tiles)``; unless ``disable_split_kv=True`` split-KV is always on in graph mode,
  and the float workspace must hold ``tmp_v``/``tmp_s`` (query heads x partial
  rows x head_dim x 4 bytes); the int workspace (the wrapper's own 8 MiB) the
  tile schedule. Sized at the row capacity (``max_total_num_rows`` or the first
  plan's rows); a plan that does not fit raises the allocator's "Buffer overflow
  ... Increase the workspace buffer size" (:func:`fa2_plan_workspace`).
- **The pinned schedule upload**: in CUDA-graph mode ``plan`` writes its schedule into
  the wrapper's pinned int buffer and queues ``cudaMemcpyAsync`` from it; given a
  copy engine (``tests/fake_copy_engine.py``) the fake queues that upload there, and a
  plan that rewrites the pinned buffer while its previous upload is still queued is
  recorded in ``Recorder.errors`` (the real upload would carry the new schedule).
- **Wrapper checks** the real code makes on the host: fixed batch size and a
  row capacity fixed by the first plan in CUDA-graph mode,
  ``q.size(0) == qo_indptr[-1]`` of the latest plan, ``out``/``lse`` shapes,
  the planned dtype.
- **trtllm-gen's workspace**: a call that returns LSE carves softmax statistics of
  ``heads x batch_size x round_up(max_q_len, 256)`` float2 plus a 1 MiB guard from
  ``workspace_buffer`` (``trtllm_fmha_kernel_launcher.cu``), the allocator's
  overflow error when it does not fit.
- **trtllm-gen** writes LSE for every row of ``query``: the launcher sets
  ``sum_seq_q = query.size(0)`` and the LSE pass covers them all, so rows past
  ``cum_seq_lens_q[batch_size]`` get stale workspace statistics
  (:data:`STALE_LSE`). Without ``multi_ctas_kv_counter_buffer`` every call
  allocates and zeroes a fresh counter buffer (counted in
  ``Recorder.counter_allocations``); a given one must be large enough for
  ``round_up(max(batch_size * heads, sm_count), 8)`` 32-bit counters. At
  execution (so at every replay) the kernel reads ``cum_seq_lens_q`` and
  ``seq_lens`` over the ``batch_size`` it was launched with; lengths that are
  not a valid batch (non-monotone, longer than the maxima, past the query
  rows) raise, where the real kernel would read garbage. ``batch_size == 0`` is
  recorded as an error.

The decode kernels (``BatchDecodeWithPagedKVCacheWrapper`` and trtllm-gen's
``trtllm_batch_decode_with_kv_cache``, read in the same release's ``decode.py`` and
``trtllm_fmha_kernel_launcher.cu``):

- **The decode wrapper** in CUDA-graph mode: the batch size fixed by the buffers
  (``len(paged_kv_indptr_buffer) - 1``, checked at every plan); ``plan`` copies
  ``indptr``/``last_page_len`` into the buffers (queued on a given copy engine: read when
  the stream runs them) and ``indices`` blocking unless they are on the wrapper's device
  (recorded in ``Recorder.errors``); every row needs a key (``(pages - 1) x page_size +
  last_page_len >= 1``, else the real plan's lengths go negative: an error); ``run``
  takes ``q`` of the batch's rows and reads the buffers when it runs; LSE base 2.
- **trtllm-gen decode**: one launch over ``query.size(0)`` requests of one row, reading
  ``seq_lens`` and ``block_tables`` when it runs, each table row at ``size(-1)`` entries
  from the last (the launcher's ``max_num_blocks_per_seq``: a non-contiguous table is
  read wrong, as the real kernel would); a ``seq_len`` of 0 or past ``max_seq_len`` is an
  error; LSE base 2 for every row; the workspace carve and the counter buffer as the
  context launcher's (``max_q_len`` = 1).

The fakes take float32 as well as bfloat16/float16 so graphcp's tests can run
in both; the real kernels take half precision only.
"""

from __future__ import annotations

import inspect
import math
import types
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

LN2 = math.log(2.0)
#: LSE the fake trtllm-gen kernel leaves in rows past the live ones (stale workspace statistics)
STALE_LSE = 77.0
#: streaming multiprocessors of the fake device (B200: 148; an SM90 device is an H100/H200: 132)
SM_COUNT = 148
HOPPER_SM_COUNT = 132
#: the int workspace the wrapper allocates itself (``prefill.py``: 8 MiB)
INT_WORKSPACE_BYTES = 8 * 1024 * 1024
FA3_MIN_Q_LEN = 65  # auto picks FA2 when no query is longer than 64 rows


def _plain(x):
    return x.tolist() if isinstance(x, torch.Tensor) else x


@dataclass
class Recorder:
    """Every call the fakes receive, and what the real kernels would have complained about."""

    calls: list[tuple[str, tuple, dict]] = field(default_factory=list)
    #: (real function's qualified name, args, kwargs) exactly as graphcp passed them
    raw: list[tuple[str, tuple, dict]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    counter_allocations: int = 0

    def named(self, name: str) -> list[tuple[tuple, dict]]:
        return [(a, k) for n, a, k in self.calls if n == name]


# ---- the attention the kernels compute ---------------------------------------------------
def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, shift: int):
    """float32 attention of ``q`` [n, Hq, D] over contiguous ``k``/``v`` [kv, Hkv, D]:
    row i sees keys ``j <= i + shift``. Returns (out [n, Hq, D], base-2 LSE [n, Hq])."""
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,khd->hnk", q.float(), kf) * scale
    rows = torch.arange(n).unsqueeze(1)
    cols = torch.arange(k.shape[0]).unsqueeze(0)
    s = s.masked_fill(~(cols <= rows + shift), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, n]; -inf where nothing is visible
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("hnk,khd->nhd", p, vf)
    return out, (lse / LN2).transpose(0, 1)


def _pages_nhd(cache: torch.Tensor, hnd: bool) -> torch.Tensor:
    """[pages, page_size, H, D] view of one K or V cache."""
    return cache.transpose(1, 2) if hnd else cache


# ---- FlashInfer's FA2 plan: the workspace it carves ----------------------------------------
def fa2_cta_tile_q(packed_qo_len: int, head_dim: int) -> int:
    """``FA2DetermineCtaTileQ`` (``utils.cuh``) on an SM80+ device, head_dim_qk == head_dim_vo."""
    if head_dim >= 512:
        return 16 if packed_qo_len <= 32 else 32
    if packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if packed_qo_len > 16 else 16


class _Allocator:
    """``AlignedAllocator``: carves named, aligned pieces out of ``space`` bytes."""

    def __init__(self, space: int) -> None:
        self.space, self.used = space, 0

    def alloc(self, size: int, alignment: int, name: str) -> None:
        start = -(-self.used // alignment) * alignment
        if start + size > self.space:
            raise RuntimeError(f"Buffer overflow when allocating memory for {name} with size {size} and alignment "
                               f"{alignment}, but only {max(self.space - start, 0)} bytes available in "
                               "AlignedAllocator. Increase the workspace buffer size.")
        self.used = start + size


def fa2_plan_workspace(total_num_rows: int, batch_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                       sm_count: int, disable_split_kv: bool, float_bytes: int = 1 << 62,
                       int_bytes: int = 1 << 62) -> tuple[int, int, bool]:
    """FA2's plan in CUDA-graph mode (no fixed split size, no window): carves the int and
    float workspaces (raising the allocator's overflow error when one does not fit) and
    returns (float bytes used, int bytes used, split_kv)."""
    group = num_qo_heads // num_kv_heads
    max_qo_len = (total_num_rows - batch_size + 1) * group
    cta = fa2_cta_tile_q(max_qo_len, head_dim)
    tiles = -(-total_num_rows * group // cta) + batch_size - 1
    max_batch_if_split = 2 * sm_count // num_kv_heads
    split = not disable_split_kv  # PrefillBinarySearchKVChunkSize: enable_cuda_graph || ...
    padded = max(max_batch_if_split, tiles)
    ints, floats = _Allocator(int_bytes), _Allocator(float_bytes)
    for name in ("request_indices", "qo_tile_indices", "kv_tile_indices"):
        ints.alloc(4 * padded, 16, f"batch_prefill_{name}")
    ints.alloc(4 * (batch_size + 1), 16, "batch_prefill_o_indptr")
    ints.alloc(4, 1, "batch_prefill_kv_chunk_size_ptr")
    ints.alloc(4, 16, "batch_prefill_total_num_rows")
    if split:
        partial_rows = -(-padded * cta // group)
        floats.alloc(num_qo_heads * partial_rows * head_dim * 4, 16, "batch_prefill_tmp_v")
        floats.alloc(num_qo_heads * partial_rows * 4, 16, "batch_prefill_tmp_s")
        ints.alloc(4 * (total_num_rows + 1), 16, "batch_prefill_merge_indptr")
    ints.alloc(padded, 16, "batch_prefill_block_valid_mask")
    return floats.used, ints.used, split


# ---- FlashInfer BatchPrefillWithPagedKVCacheWrapper kernels ------------------------------
@torch.library.custom_op("graphcp_fake::batch_prefill_paged", mutates_args=("out", "lse"))
def batch_prefill_paged(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor],
    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor,
    page_size: int, hnd: bool, sm_scale: float, descriptor_rows: int, causal: bool = True,
) -> None:
    """One paged prefill launch. ``descriptor_rows < 0``: FA2, rows from the device
    buffers; otherwise FA3, whose TMA descriptor covers that many rows of ``q``."""
    kp, vp = _pages_nhd(k_cache, hnd), _pages_nhd(v_cache, hnd)
    qo, kvp, idx, last = (t.tolist() for t in (qo_indptr, kv_indptr, kv_indices, last_page_len))
    if descriptor_rows < 0 and qo[-1] > q.shape[0]:
        raise RuntimeError(f"fake FA2: qo_indptr[-1]={qo[-1]} rows, but q has {q.shape[0]} (out-of-bounds read)")
    limit = qo[-1] if descriptor_rows < 0 else min(qo[-1], descriptor_rows)
    for b in range(len(qo) - 1):
        q0, q1 = qo[b], min(qo[b + 1], limit)
        if q1 <= q0:
            continue
        pages = idx[kvp[b] : kvp[b + 1]]
        kv_len = (len(pages) - 1) * page_size + last[b]
        k = kp[pages].flatten(0, 1)[:kv_len]
        v = vp[pages].flatten(0, 1)[:kv_len]
        o, l2 = attend_rows(q[q0:q1], k, v, sm_scale, kv_len - (qo[b + 1] - qo[b]) if causal else kv_len)
        out[q0:q1] = o.to(out.dtype)
        if lse is not None:
            lse[q0:q1] = l2


@batch_prefill_paged.register_fake
def _(q, k_cache, v_cache, out, lse, qo_indptr, kv_indptr, kv_indices, last_page_len, page_size, hnd, sm_scale,
      descriptor_rows, causal=True):
    return None


class FakePrefillWrapper:
    """``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` (paged prefill)."""

    def __init__(self, rec: Recorder, capability: tuple[int, int], copy_engine, *args, **kwargs) -> None:
        rec.raw.append(("BatchPrefillWithPagedKVCacheWrapper.__init__", args, kwargs))
        self.copy_engine = copy_engine
        self._upload_at: int | None = None  # queue index of the last schedule upload
        self._pinned_schedule = torch.zeros(1, dtype=torch.int32)  # total_num_rows, as plan writes it
        self.device_schedule = torch.zeros(1, dtype=torch.int32)
        self._init(rec, capability, *args, **kwargs)

    def plan(self, *args, **kwargs) -> None:
        self.rec.raw.append(("BatchPrefillWithPagedKVCacheWrapper.plan", args, kwargs))
        self._plan(*args, **kwargs)

    def run(self, *args, **kwargs):
        self.rec.raw.append(("BatchPrefillWithPagedKVCacheWrapper.run", args, kwargs))
        return self._run(*args, **kwargs)

    def _init(self, rec: Recorder, capability: tuple[int, int], float_workspace_buffer: torch.Tensor,
                 kv_layout: str = "NHD", use_cuda_graph: bool = False, qo_indptr_buf=None, paged_kv_indptr_buf=None,
                 paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None, custom_mask_buf=None,
                 mask_indptr_buf=None, backend: str = "auto", jit_args=None, jit_kwargs=None,
                 variant_owns_mask: bool = False, max_total_num_rows: Optional[int] = None) -> None:
        rec.calls.append(("init", (float_workspace_buffer, kv_layout), dict(
            use_cuda_graph=use_cuda_graph, qo_indptr_buf=qo_indptr_buf, paged_kv_indptr_buf=paged_kv_indptr_buf,
            paged_kv_indices_buf=paged_kv_indices_buf, paged_kv_last_page_len_buf=paged_kv_last_page_len_buf,
            backend=backend, max_total_num_rows=max_total_num_rows)))
        if backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"fake wrapper models backends auto, fa2 and fa3, got {backend!r}")
        if backend == "fa3" and capability[0] != 9:
            raise RuntimeError(f"FA3 needs SM90, the fake device is SM{capability[0]}{capability[1]}")
        self.rec, self.capability = rec, capability
        self.workspace_bytes = float_workspace_buffer.numel() * float_workspace_buffer.element_size()
        self.kv_layout, self.use_cuda_graph = kv_layout, use_cuda_graph
        self.requested_backend, self.backend = backend, None if backend == "auto" else backend
        self.bufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)
        if use_cuda_graph and any(not isinstance(b, torch.Tensor) for b in self.bufs):
            raise ValueError("qo_indptr_buf etc. should be torch.Tensors in CUDA graph mode")
        self.fixed_batch = len(qo_indptr_buf) - 1 if use_cuda_graph else None
        self.max_rows = max_total_num_rows
        self.planned: dict[str, Any] | None = None

    def _plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, **kw) -> None:
        self.rec.calls.append(("plan", tuple(_plain(a) for a in (qo_indptr, paged_kv_indptr, paged_kv_indices,
                                                                  paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                                                                  head_dim_qk, page_size)),
                               {k: _plain(v) for k, v in dict(causal=causal, sm_scale=sm_scale,
                                                              q_data_type=q_data_type,
                                                              kv_data_type=kv_data_type, **kw).items()}))
        qo = qo_indptr.tolist()
        batch, rows = len(qo) - 1, qo[-1]
        if self.backend is None:  # auto: resolved at the first plan, then kept (CUDA-graph mode)
            long_q = max((b - a for a, b in zip(qo, qo[1:])), default=0) >= FA3_MIN_Q_LEN
            self.backend = "fa3" if self.capability[0] == 9 and long_q else "fa2"
        if self.use_cuda_graph:
            if batch != self.fixed_batch:
                raise ValueError(f"The batch size should be fixed in cuda graph mode: {batch} vs {self.fixed_batch}")
            if self.max_rows is None:
                self.max_rows = rows
            elif rows > self.max_rows:
                raise ValueError(f"The total number of rows in qo_indptr {rows} in cuda graph mode cannot exceed "
                                 f"the number of rows set during initialization {self.max_rows}.")
            if len(paged_kv_indices) > len(self.bufs[2]):
                raise ValueError("The length of paged_kv_indices exceeds the allocated buffer size.")
            if self.backend == "fa2":  # the schedule is sized at the row capacity
                fa2_plan_workspace(self.max_rows, batch, num_qo_heads, num_kv_heads, head_dim_qk,
                                   HOPPER_SM_COUNT if self.capability[0] == 9 else SM_COUNT,
                                   bool(kw.get("disable_split_kv", False)), self.workspace_bytes, INT_WORKSPACE_BYTES)
            for buf, src in zip(self.bufs, (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)):
                buf[: len(src)].copy_(src)
            eng = self.copy_engine
            if eng is not None:  # the schedule: written to the pinned buffer, uploaded when the stream gets there
                if self._upload_at is not None and eng.ran <= self._upload_at:
                    self.rec.errors.append("fake FlashInfer: plan rewrote the pinned int workspace while the "
                                           "previous plan's upload was still queued")
                self._pinned_schedule[0] = rows
                eng.upload(self.device_schedule, self._pinned_schedule)
                self._upload_at = len(eng.queue) - 1
            bufs = self.bufs
        else:
            bufs = tuple(t.clone() for t in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len))
        self.planned = dict(rows=rows, bufs=bufs, page_size=page_size, causal=causal,
                            sm_scale=sm_scale if sm_scale is not None else head_dim_qk ** -0.5,
                            q_dtype=q_data_type, kv_dtype=kv_data_type or q_data_type, heads=num_qo_heads)

    def _run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, lse_base="log2", lse_layout="NH", enable_pdl=None, window_left=None, **kw):
        self.rec.calls.append(("run", (q, paged_kv_cache), dict(out=out, lse=lse, return_lse=return_lse, **kw)))
        p = self.planned
        if p is None:
            raise RuntimeError("plan() must be called before run()")
        if q.size(0) != p["rows"]:
            raise ValueError(f"q.shape[0] ({q.size(0)}) does not match qo_indptr[-1] ({p['rows']}).")
        if q.dtype != p["q_dtype"] or paged_kv_cache.dtype != p["kv_dtype"]:
            raise ValueError(f"q {q.dtype} / kv {paged_kv_cache.dtype} differ from the planned {p['q_dtype']}")
        if out is None:
            out = torch.zeros_like(q)
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
        if return_lse and lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if lse is not None and (tuple(lse.shape) != tuple(q.shape[:2]) or lse.dtype != torch.float32):
            raise ValueError(f"lse must be float32 {tuple(q.shape[:2])}, got {lse.dtype} {tuple(lse.shape)}")
        fa3 = self.backend == "fa3"
        if fa3 and q.size(0) == 0:
            self.rec.errors.append("fake FA3: Failed to initialize the TMA descriptor (q has 0 rows)")
        k, v = paged_kv_cache.unbind(1)
        torch.ops.graphcp_fake.batch_prefill_paged(
            q, k, v, out, lse, *p["bufs"], p["page_size"], self.kv_layout == "HND", float(p["sm_scale"]),
            q.size(0) if fa3 else -1, bool(p["causal"]))
        return (out, lse) if return_lse else out


# ---- trtllm-gen context FMHA -------------------------------------------------------------
@torch.library.custom_op("graphcp_fake::trtllm_context", mutates_args=("out", "lse"))
def trtllm_context(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor],
    block_tables: torch.Tensor, seq_lens: torch.Tensor, cum_seq_lens_q: torch.Tensor,
    max_q_len: int, max_kv_len: int, scale: float, batch_size: int, hnd: bool, causal: bool = True,
) -> None:
    """One trtllm-gen context launch over ``batch_size`` sequences, reading their
    lengths now (at replay: what the buffers hold then)."""
    kp, vp = _pages_nhd(k_cache, hnd), _pages_nhd(v_cache, hnd)
    page_size = kp.shape[1]
    sum_seq_q = query.shape[0]  # the launcher's sum_seq_q = query.size(0)
    cu = cum_seq_lens_q[: batch_size + 1].tolist()
    kv = seq_lens[:batch_size].tolist()
    table = block_tables[:batch_size].tolist()
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > sum_seq_q:
        raise RuntimeError(f"fake trtllm-gen: cum_seq_lens_q {cu} is not a batch of the {sum_seq_q} query rows")
    for s in range(batch_size):
        q_len = cu[s + 1] - cu[s]
        if q_len > max_q_len or not 1 <= kv[s] <= max_kv_len or (causal and q_len > kv[s]):
            raise RuntimeError(f"fake trtllm-gen: sequence {s} has q_len {q_len}, kv_len {kv[s]}; launched with "
                               f"max_q_len={max_q_len}, max_kv_len={max_kv_len}")
        if q_len == 0:
            continue
        pages = table[s][: -(-kv[s] // page_size)]
        k = kp[pages].flatten(0, 1)[: kv[s]]
        v = vp[pages].flatten(0, 1)[: kv[s]]
        o, l2 = attend_rows(query[cu[s] : cu[s + 1]], k, v, scale, kv[s] - q_len if causal else kv[s])
        out[cu[s] : cu[s + 1]] = o.to(out.dtype)
        if lse is not None:
            lse[cu[s] : cu[s + 1]] = l2
    if lse is not None:
        lse[cu[-1] :] = STALE_LSE  # the LSE pass covers all sum_seq_q rows


@trtllm_context.register_fake
def _(query, k_cache, v_cache, out, lse, block_tables, seq_lens, cum_seq_lens_q, max_q_len, max_kv_len, scale,
      batch_size, hnd, causal=True):
    return None


def counter_bytes(batch_size: int, num_qo_heads: int, sm_count: int = SM_COUNT) -> int:
    """``get_trtllm_gen_multi_ctas_kv_counter_bytes``."""
    return -(-max(batch_size * num_qo_heads, sm_count) // 8) * 8 * 4


def make_trtllm_fn(rec: Recorder):
    def trtllm_batch_context_with_kv_cache(*args, **kwargs):
        rec.raw.append(("prefill.trtllm_batch_context_with_kv_cache", args, kwargs))
        return impl(*args, **kwargs)

    def impl(
        query, kv_cache, workspace_buffer, block_tables, seq_lens, max_q_len, max_kv_len, bmm1_scale, bmm2_scale,
        batch_size, cum_seq_lens_q, cum_seq_lens_kv, window_left=-1, out=None, out_dtype=None, o_sf_scale=None,
        o_sf_vec_size=None, kv_layout="HND", enable_pdl=None, sinks=None, kv_cache_sf=None,
        skip_softmax_threshold_scale_factor=None, uses_shared_paged_kv_idx=True, causal=True, lse=None,
        return_lse=False, multi_ctas_kv_counter_buffer=None, use_fp16_softmax=None, uses_spcompress=None,
        backend="trtllm-gen", window_right=-1, variable_window_token_starts=None, variable_window_token_ends=None,
    ):
        with _disable_current_modes():  # the fake's own bookkeeping: not part of a captured launch
            rec.calls.append(("trtllm", (), dict(
                query=query, kv_cache=kv_cache, workspace_buffer=workspace_buffer,
                block_tables=block_tables.tolist(), seq_lens=seq_lens.tolist(), max_q_len=max_q_len,
                max_kv_len=max_kv_len, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, batch_size=batch_size,
                cum_seq_lens_q=cum_seq_lens_q.tolist(), cum_seq_lens_kv=cum_seq_lens_kv.tolist(),
                window_left=window_left, out=out, kv_layout=kv_layout, lse=lse, return_lse=return_lse,
                multi_ctas_kv_counter_buffer=multi_ctas_kv_counter_buffer, causal=causal)))
        if window_left != -1 or bmm2_scale != 1.0:
            raise NotImplementedError("the fake models attention without a window and bmm2_scale 1")
        if batch_size == 0:
            rec.errors.append("fake trtllm-gen: launch with batch_size=0")
        if tuple(block_tables.shape[:1]) != (batch_size,) or tuple(seq_lens.shape) != (batch_size,):
            raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} do not "
                             f"match batch_size={batch_size}")
        if cum_seq_lens_q.shape[0] != batch_size + 1 or cum_seq_lens_kv.shape[0] != batch_size + 1:
            raise ValueError("cum_seq_lens_q/kv must have batch_size + 1 entries")
        if out is None:
            out = torch.empty_like(query)
        if out.shape != query.shape:
            raise ValueError(f"out must have the query's shape {tuple(query.shape)}, got {tuple(out.shape)}")
        heads = query.size(1)
        if lse is not None and (tuple(lse.shape) != (query.size(0), heads) or lse.dtype != torch.float32):
            raise ValueError(f"lse must be float32 {(query.size(0), heads)}, got {lse.dtype} {tuple(lse.shape)}")
        if lse is None and return_lse:
            lse = torch.empty(query.size(0), heads, dtype=torch.float32, device=query.device)
        if lse is not None:  # the launcher's softmax statistics, then its 1 MiB guard
            _Allocator(workspace_buffer.numel() * workspace_buffer.element_size()).alloc(
                8 * heads * batch_size * (-(-int(max_q_len) // 256) * 256) + (1 << 20), 16,
                "trtllm_gen_softmax_workspace")
        need = counter_bytes(batch_size, heads)
        if multi_ctas_kv_counter_buffer is None:
            rec.counter_allocations += 1  # FlashInfer creates a fresh zeroed buffer for this call
        else:
            got = multi_ctas_kv_counter_buffer.numel() * multi_ctas_kv_counter_buffer.element_size()
            if got < need or not multi_ctas_kv_counter_buffer.is_contiguous():
                raise ValueError(f"multi_ctas_kv_counter_buffer is too small: got {got} bytes, need {need} bytes")
            with _disable_current_modes():  # the fake's own check, not part of a launch
                if multi_ctas_kv_counter_buffer.any():
                    raise ValueError("multi_ctas_kv_counter_buffer must be zero-initialised (the kernel resets it)")
        k, v = kv_cache.unbind(1)
        torch.ops.graphcp_fake.trtllm_context(query, k, v, out, lse, block_tables, seq_lens, cum_seq_lens_q,
                                              int(max_q_len), int(max_kv_len), float(bmm1_scale), int(batch_size),
                                              kv_layout == "HND", bool(causal))
        return (out, lse) if return_lse else out

    trtllm_batch_context_with_kv_cache.__signature__ = inspect.signature(impl)  # what graphcp inspects
    return trtllm_batch_context_with_kv_cache


# ---- FlashInfer BatchDecodeWithPagedKVCacheWrapper ------------------------------------------
@torch.library.custom_op("graphcp_fake::batch_decode_paged", mutates_args=("out", "lse"))
def batch_decode_paged(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor],
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor, page_size: int, hnd: bool,
    sm_scale: float,
) -> None:
    """One decode launch: row b over its pages ``indices[indptr[b]:indptr[b + 1]]``, read now."""
    kp, vp = _pages_nhd(k_cache, hnd), _pages_nhd(v_cache, hnd)
    kvp, idx, last = (t.tolist() for t in (kv_indptr, kv_indices, last_page_len))
    for b in range(q.shape[0]):
        pages = idx[kvp[b] : kvp[b + 1]]
        kv_len = (len(pages) - 1) * page_size + last[b]
        if kv_len < 1:
            raise RuntimeError(f"fake decode: row {b} has {kv_len} keys")
        o, l2 = attend_rows(q[b : b + 1], kp[pages].flatten(0, 1)[:kv_len], vp[pages].flatten(0, 1)[:kv_len],
                            sm_scale, kv_len)
        out[b : b + 1] = o.to(out.dtype)
        if lse is not None:
            lse[b : b + 1] = l2


@batch_decode_paged.register_fake
def _(q, k_cache, v_cache, out, lse, kv_indptr, kv_indices, last_page_len, page_size, hnd, sm_scale):
    return None


class FakeDecodeWrapper:
    """``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` (paged decode, one row a request)."""

    def __init__(self, rec: Recorder, copy_engine, *args, **kwargs) -> None:
        rec.raw.append(("BatchDecodeWithPagedKVCacheWrapper.__init__", args, kwargs))
        self.rec, self.copy_engine = rec, copy_engine
        self._upload_at: int | None = None
        self._init(*args, **kwargs)

    def _init(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
              use_tensor_cores: bool = False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
              paged_kv_last_page_len_buffer=None, backend: str = "auto", jit_args=None, jit_kwargs=None) -> None:
        self.rec.calls.append(("decode_init", (float_workspace_buffer, kv_layout), dict(
            use_cuda_graph=use_cuda_graph, use_tensor_cores=use_tensor_cores, backend=backend)))
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        if use_cuda_graph and any(not isinstance(b, torch.Tensor) for b in self.bufs):
            raise ValueError("paged_kv_indptr_buffer etc. should be torch.Tensors in CUDA graph mode")
        self.kv_layout, self.use_cuda_graph = kv_layout, use_cuda_graph
        self.device = float_workspace_buffer.device
        self.fixed_batch = len(paged_kv_indptr_buffer) - 1 if use_cuda_graph else None
        self.planned: dict[str, Any] | None = None

    def plan(self, *args, **kwargs) -> None:
        self.rec.raw.append(("BatchDecodeWithPagedKVCacheWrapper.plan", args, kwargs))
        self._plan(*args, **kwargs)

    def run(self, *args, **kwargs):
        self.rec.raw.append(("BatchDecodeWithPagedKVCacheWrapper.run", args, kwargs))
        return self._run(*args, **kwargs)

    def _plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
              q_data_type="float16", kv_data_type=None, sm_scale=None, non_blocking=True, **kw) -> None:
        self.rec.calls.append(("decode_plan", tuple(_plain(a) for a in (indptr, indices, last_page_len, num_qo_heads,
                                                                         num_kv_heads, head_dim, page_size)),
                               {k: _plain(v) for k, v in dict(q_data_type=q_data_type, sm_scale=sm_scale,
                                                              non_blocking=non_blocking, **kw).items()}))
        batch = len(last_page_len)
        if self.use_cuda_graph and batch != self.fixed_batch:
            raise ValueError(f"The batch size should be fixed in cudagraph mode, the runtime batch size {batch} "
                             f" mismatches the batch size set during initialization {self.fixed_batch}")
        if len(indices) > len(self.bufs[1]):
            raise ValueError("The size of indices should be less than or equal to the allocated buffer")
        ptr, last = indptr.tolist(), last_page_len.tolist()
        for b in range(batch):
            if ptr[b + 1] <= ptr[b] or not 1 <= last[b] <= page_size:
                self.rec.errors.append(f"fake decode plan: row {b} has pages {ptr[b + 1] - ptr[b]}, last_page_len "
                                       f"{last[b]}: kv length {(ptr[b + 1] - ptr[b] - 1) * page_size + last[b]}")
        if indices.device != self.device:  # the real copy is blocking then (non_blocking=(same device))
            self.rec.errors.append("fake decode plan: indices from the host: a blocking copy")
        eng = self.copy_engine
        if eng is not None:  # indptr / last_page_len: read when the stream runs the copies
            if self._upload_at is not None and eng.ran <= self._upload_at:
                self.rec.errors.append("fake decode plan: rewrote the pinned indptr/last_page_len while the previous "
                                       "plan's copies were still queued")
            eng.upload(self.bufs[0], indptr)
            eng.upload(self.bufs[2], last_page_len)
            self._upload_at = len(eng.queue) - 1
            eng.upload(self.bufs[1][: len(indices)], indices)  # device to device: queued on the stream too
        else:
            self.bufs[0].copy_(indptr)
            self.bufs[2].copy_(last_page_len)
            self.bufs[1][: len(indices)].copy_(indices)
        self.planned = dict(page_size=page_size, sm_scale=sm_scale if sm_scale is not None else head_dim ** -0.5,
                            q_dtype=q_data_type, kv_dtype=kv_data_type or q_data_type)

    def _run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
             return_lse=False, enable_pdl=None, window_left=None, **kw):
        self.rec.calls.append(("decode_run", (q, paged_kv_cache), dict(out=out, lse=lse, return_lse=return_lse)))
        p = self.planned
        if p is None:
            raise RuntimeError("plan() must be called before run()")
        if self.use_cuda_graph and q.size(0) != self.fixed_batch:
            raise ValueError(f"q implies q_len_per_req={q.size(0) / self.fixed_batch}, but the non-tensor-core decode "
                             "kernel only supports q_len_per_req=1")
        if q.dtype != p["q_dtype"] or paged_kv_cache.dtype != p["kv_dtype"]:
            raise ValueError(f"q {q.dtype} / kv {paged_kv_cache.dtype} differ from the planned {p['q_dtype']}")
        if out is None:
            out = torch.empty_like(q)
        if return_lse and lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if lse is not None and (tuple(lse.shape) != tuple(q.shape[:2]) or lse.dtype != torch.float32):
            raise ValueError(f"lse must be float32 {tuple(q.shape[:2])}, got {lse.dtype} {tuple(lse.shape)}")
        k, v = paged_kv_cache.unbind(1)
        torch.ops.graphcp_fake.batch_decode_paged(q, k, v, out, lse, self.bufs[0], self.bufs[1], self.bufs[2],
                                                  p["page_size"], self.kv_layout == "HND", float(p["sm_scale"]))
        return (out, lse) if return_lse else out


# ---- trtllm-gen generation FMHA (decode) ---------------------------------------------------
@torch.library.custom_op("graphcp_fake::trtllm_decode", mutates_args=("out", "lse"))
def trtllm_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor],
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float, hnd: bool,
) -> None:
    """One trtllm-gen decode launch over ``query.size(0)`` one-row requests, reading the
    lengths and the table now, each table row ``size(-1)`` entries after the last."""
    kp, vp = _pages_nhd(k_cache, hnd), _pages_nhd(v_cache, hnd)
    page_size = kp.shape[1]
    batch, width = query.shape[0], block_tables.shape[-1]
    flat = torch.as_strided(block_tables, (batch, width), (width, 1)).tolist()  # max_num_blocks_per_seq = size(-1)
    kv = seq_lens[:batch].tolist()
    for b in range(batch):
        if not 1 <= kv[b] <= max_seq_len:
            raise RuntimeError(f"fake trtllm-gen decode: request {b} has seq_len {kv[b]}, max_seq_len {max_seq_len}")
        pages = flat[b][: -(-kv[b] // page_size)]
        o, l2 = attend_rows(query[b : b + 1], kp[pages].flatten(0, 1)[: kv[b]], vp[pages].flatten(0, 1)[: kv[b]],
                            scale, kv[b])
        out[b : b + 1] = o.to(out.dtype)
        if lse is not None:
            lse[b : b + 1] = l2


@trtllm_decode.register_fake
def _(query, k_cache, v_cache, out, lse, block_tables, seq_lens, max_seq_len, scale, hnd):
    return None


def make_trtllm_decode_fn(rec: Recorder):
    def trtllm_batch_decode_with_kv_cache(*args, **kwargs):
        rec.raw.append(("decode.trtllm_batch_decode_with_kv_cache", args, kwargs))
        return impl(*args, **kwargs)

    def impl(
        query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len, bmm1_scale=1.0, bmm2_scale=1.0,
        window_left=-1, out=None, out_dtype=None, o_sf_scale=None, o_sf_vec_size=None, sinks=None, kv_layout="HND",
        enable_pdl=None, backend="auto", q_len_per_req=1, o_scale=1.0, mask=None, max_q_len=None,
        cum_seq_lens_q=None, skip_softmax_threshold_scale_factor=None, kv_cache_sf=None,
        uses_shared_paged_kv_idx=True, lse=None, return_lse=False, bmm1_scale_log2=None,
        multi_ctas_kv_counter_buffer=None, enable_block_sparse_attention=False, cp_world=1, cp_rank=0,
        causal_seqlens_kv_global=None, bf16q_fp8kv_transform_mode=None, request_order=None, request_order_plan=None,
        sparse_top_k=0, length_aware_schedule=False,
    ):
        with _disable_current_modes():
            rec.calls.append(("trtllm_decode", (), dict(
                block_tables_shape=tuple(block_tables.shape), block_tables_contiguous=block_tables.is_contiguous(),
                seq_lens=seq_lens.tolist(), max_seq_len=max_seq_len, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale,
                kv_layout=kv_layout, backend=backend, lse=lse, return_lse=return_lse,
                multi_ctas_kv_counter_buffer=multi_ctas_kv_counter_buffer)))
        if window_left != -1 or bmm2_scale != 1.0 or q_len_per_req != 1:
            raise NotImplementedError("the fake models one-row decode without a window and bmm2_scale 1")
        batch, heads = query.size(0), query.size(1)
        if tuple(block_tables.shape[:1]) != (batch,) or seq_lens.shape[0] < batch:
            raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} do not "
                             f"match the batch of {batch}")
        if out is None:
            out = torch.empty_like(query)
        if lse is None and return_lse:
            lse = torch.empty(batch, heads, dtype=torch.float32, device=query.device)
        if lse is not None:
            if tuple(lse.shape) != (batch, heads) or lse.dtype != torch.float32:
                raise ValueError(f"lse must be float32 {(batch, heads)}, got {lse.dtype} {tuple(lse.shape)}")
            _Allocator(workspace_buffer.numel() * workspace_buffer.element_size()).alloc(
                8 * heads * batch * 256 + (1 << 20), 16, "trtllm_gen_softmax_workspace")
        if multi_ctas_kv_counter_buffer is None:
            rec.counter_allocations += 1
        elif multi_ctas_kv_counter_buffer.numel() * multi_ctas_kv_counter_buffer.element_size() < counter_bytes(
                batch, heads):
            raise ValueError("multi_ctas_kv_counter_buffer is too small")
        k, v = kv_cache.unbind(1)
        torch.ops.graphcp_fake.trtllm_decode(query, k, v, out, lse, block_tables, seq_lens, int(max_seq_len),
                                             float(bmm1_scale), kv_layout == "HND")
        return (out, lse) if return_lse else out

    trtllm_batch_decode_with_kv_cache.__signature__ = inspect.signature(impl)
    return trtllm_batch_decode_with_kv_cache


def fake_flashinfer(rec: Recorder, capability: tuple[int, int] = (10, 0), copy_engine=None) -> types.ModuleType:
    """A ``flashinfer`` module for a device of ``capability`` (SM100 by default);
    ``copy_engine``: a :class:`fake_copy_engine.FakeCopyEngine` the wrapper's pinned
    schedule uploads go through (None: uploads are not modelled)."""
    fi = types.ModuleType("flashinfer")

    def wrapper(*args, **kwargs):
        return FakePrefillWrapper(rec, capability, copy_engine, *args, **kwargs)

    fi.BatchPrefillWithPagedKVCacheWrapper = wrapper
    fi.BatchDecodeWithPagedKVCacheWrapper = lambda *a, **k: FakeDecodeWrapper(rec, copy_engine, *a, **k)
    fi.prefill = types.ModuleType("flashinfer.prefill")
    fi.prefill.trtllm_batch_context_with_kv_cache = make_trtllm_fn(rec)
    fi.decode = types.ModuleType("flashinfer.decode")
    fi.decode.trtllm_batch_decode_with_kv_cache = make_trtllm_decode_fn(rec)
    return fi
