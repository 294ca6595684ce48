"""``flashinfer``: FlashInfer's paged prefill (``BatchPrefillWithPagedKVCacheWrapper``),
on its FA2 kernels.

Phases. ``prepare(meta)`` builds the wrapper's arguments from the host copy of
the metadata and calls ``wrapper.plan`` (host work plus small uploads into the
wrapper's fixed device buffers); ``forward`` calls ``wrapper.run`` once per
layer. The wrapper is built with ``use_cuda_graph=True`` and fixed buffers, so a
``run`` captured in a graph reads whatever the latest ``plan`` wrote: full-graph
mode is sound provided ``prepare`` (plan) runs before *every* replay.

Why FA2 (``backend="fa2"``, not the default ``"auto"``): in CUDA-graph mode
FA2's kernels take every row count from device memory (the tile schedule and
``total_num_rows`` that ``plan`` writes into the int workspace, ``qo_indptr``),
so a launch captured for one batch replays for another. ``auto`` resolves to
FA3 on SM90, and FA3 bakes the query row count into its TMA descriptor at the
call (``params.nnz_qo = q.size(0)`` in ``batch_prefill_sm90.cu``): a graph
captured at one row count reads no row past it on replay, and at zero rows the
descriptor cannot even be built. (FA3 would be faster for eager calls on
Hopper; one wrapper serves eager, breakable and full-graph calls alike.)

Split-KV off (``disable_split_kv=True`` at every plan). In CUDA-graph mode FA2 otherwise
always splits the keys (``scheduler.cuh``: ``enable_cuda_graph || ...``), pads its grid to
the tiles of the row capacity and carves ``tmp_v`` of query heads x those tiles' rows x
head_dim x 4 bytes from the float workspace: past a GB for an 8B model at the engine's
default 65K rows, where the fixed workspace has 128 MiB. A prefill's query tiles fill the
GPU without splitting keys; no scratch, no merge kernel. A plan the library still refuses
(a C++ ``RuntimeError``) becomes a one-line :class:`~graphcp.errors.ConfigError` naming
the sizes.

Pinned schedule. ``plan`` writes its tile schedule into the wrapper's pinned int buffer and
uploads it with ``cudaMemcpyAsync`` (``scheduler.cuh``): the copy reads the buffer when it
runs. Each plan marks an event after itself and the next plan waits on it before the
library rewrites the buffer (:class:`~graphcp.attention.staging.PinnedStaging`): a
pipeline stage before the last runs ahead of its GPU into the next micro-batch.

Argument contract (what ``plan`` receives):

- the batch is always ``max_segments`` long (CUDA-graph mode fixes it): the
  metadata's segments first, then inert padding segments;
- a segment with ``q_len == 0`` (an empty zigzag block, or padding) is *inert*:
  ``qo_indptr`` repeats, and it gets one page, the scratch page 0, with
  ``last_page_len = 1``. FlashInfer's scheduler makes ``ceil(q_len * group /
  tile)`` = 0 work tiles for it, so the page is never read; giving it one real
  key keeps every derived kv length positive (0 pages with last_page_len 0
  would give ``(0 - 1) * page_size + 0 < 0``);
- other segments get their ``ceil(kv_len / page_size)`` pages from the page
  table and ``last_page_len = kv_len - (pages - 1) * page_size`` (1..page_size);
- ``causal=True``: FlashInfer aligns the causal mask bottom-right when
  ``q_len < kv_len`` (query i of a request sees keys ``<= kv_len - q_len + i``,
  see the custom-mask example in the wrapper's docstring), which is our segment
  rule.

Rows. The first ``plan`` of a wrapper in CUDA-graph mode fixes its row
capacity (``total_num_rows``, and with it the launch shape); the constructor
therefore plans once with ``max_q_rows`` rows before any real plan. ``run``
checks ``q.shape[0] == qo_indptr[-1]`` of the latest plan, so:

- live metadata (eager calls, breaks): ``run`` sees ``q[:num_q_rows]``; padding
  rows of ``q`` are no query. With no rows there is no call at all (a zero-row
  launch is not a kernel anyone needs, and some backends fail on it);
- static metadata (:attr:`AttentionMetadata.static`, a full-graph capture):
  ``prepare`` plans the bucket's ``max_q_len`` rows as one causal segment over
  as many keys on the (repeated) scratch page, so every row sees a key, and
  ``run`` sees the whole ``q``. That plan only serves the
  capture (and its warm-up); every replay reads the batch the latest
  ``prepare`` planned, whose ``qo_indptr`` ends at the live rows, so FA2 writes
  no padding row.

Non-causal metadata (ring steps, always live): planned with ``causal=False``; a
segment whose rows see no key (``kv_len == 0``) gets the inert scratch key like an
empty one, and after ``run`` its rows get the contract's output 0 and LSE -inf.
Each ring step has its own backend instance (its own plan); they may share one
float workspace (``workspace=``), as they run one after another on one stream.

FlashInfer returns base-2 LSE; it is converted to base e in place with a factor
chosen per row on the device (ln 2 for real rows, exactly 1 for padding rows),
so no live row count is baked into a captured graph and padding rows keep their
values.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from graphcp.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec, BatchRequests
from graphcp.attention.catalog import register_backend
from graphcp.attention.staging import PinnedStaging, to_device
from graphcp.errors import ConfigError
from graphcp.kv.page_table import SCRATCH_PAGE

FLASHINFER_EXTRA = 'pip install -e ".[flashinfer]"'
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024
LN2 = math.log(2.0)
#: FlashInfer kernels whose row counts come from device memory in CUDA-graph mode (see above)
WRAPPER_BACKEND = "fa2"


def import_flashinfer(backend: str, submodule: str | None = None) -> ModuleType:
    """Import FlashInfer (or ``flashinfer.<submodule>``) for ``backend``, with an
    error that names the install extra when it is missing."""
    name = "flashinfer" if submodule is None else f"flashinfer.{submodule}"
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(
            f"the {backend!r} attention backend needs FlashInfer, which could not be imported "
            f"({e}); install it with `{FLASHINFER_EXTRA}`"
        ) from e


def keyed_segments(meta: AttentionMetadata) -> np.ndarray:
    """bool [S]: segments a kernel attends over their own pages (rows and keys); the
    others (no rows, or non-causal rows that see no key) get one inert scratch key."""
    return (meta.q_lens_host > 0) & (meta.kv_lens_host > 0)


def effective_kv_lens(meta: AttentionMetadata) -> np.ndarray:
    """kv lengths handed to the kernels: segments with no query rows (or, non-causal,
    no keys) become one key on the scratch page (see the module docstring)."""
    return np.where(keyed_segments(meta), meta.kv_lens_host, 1).astype(np.int32)


def write_no_key_rows(meta: AttentionMetadata, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """The contract's values for non-causal rows that see no key (output 0, LSE -inf),
    over what a kernel computed for them against the inert scratch key."""
    if meta.causal:
        return
    rows = meta.no_key_rows()
    if rows.size:
        idx = to_device(rows, out.device)
        out.index_fill_(0, idx, 0)
        if lse is not None:
            lse.index_fill_(0, idx, float("-inf"))


class Base2Lse:
    """Converts a base-2 LSE buffer to base e for the rows of the live segments,
    reading the row count on the device (graph-safe), leaving padding rows as
    they were (multiplied by exactly 1)."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.rows = torch.arange(max_rows, dtype=torch.int32, device=device)
        self.mask = torch.empty(max_rows, dtype=torch.bool, device=device)
        self.factor = torch.empty(max_rows, dtype=torch.float32, device=device)
        self.ln2 = torch.tensor(LN2, dtype=torch.float32, device=device)
        self.one = torch.tensor(1.0, dtype=torch.float32, device=device)

    def to_base_e(self, lse: torch.Tensor, cu_seqlens_q: torch.Tensor) -> None:
        n = lse.shape[0]
        if n > self.rows.shape[0]:
            raise ValueError(f"lse has {n} rows, more than the backend's max_q_rows={self.rows.shape[0]}")
        mask, factor = self.mask[:n], self.factor[:n]
        torch.lt(self.rows[:n], cu_seqlens_q[-1:], out=mask)
        torch.where(mask, self.ln2, self.one, out=factor)
        lse.mul_(factor.unsqueeze(1))

    def copy_live_base_e(self, src: torch.Tensor, dst: torch.Tensor, cu_seqlens_q: torch.Tensor) -> None:
        """``dst[i] = src[i] * ln 2`` for the live rows (``i < cu_seqlens_q[-1]``, read
        on the device); padding rows of ``dst`` keep their values (``src`` is scratch)."""
        n = dst.shape[0]
        if n > self.rows.shape[0] or src.shape != dst.shape:
            raise ValueError(f"lse rows {tuple(src.shape)} -> {tuple(dst.shape)} exceed max_q_rows="
                             f"{self.rows.shape[0]} or differ")
        mask = self.mask[:n]
        torch.lt(self.rows[:n], cu_seqlens_q[-1:], out=mask)
        src.mul_(self.ln2)
        torch.where(mask.unsqueeze(1), src, dst, out=dst)


@dataclass(frozen=True)
class PagedPlanArgs:
    """Host arrays for ``wrapper.plan``, padded to the wrapper's batch size."""

    qo_indptr: np.ndarray  # [B + 1]
    paged_kv_indptr: np.ndarray  # [B + 1]
    paged_kv_indices: np.ndarray  # [paged_kv_indptr[-1]]
    paged_kv_last_page_len: np.ndarray  # [B]

    @classmethod
    def build(cls, meta: AttentionMetadata, batch: int) -> "PagedPlanArgs":
        s = meta.num_segments
        if s > batch:
            raise ValueError(f"metadata has {s} segments, the backend was built for max_segments={batch}")
        ps = meta.page_size
        kv = effective_kv_lens(meta)
        live = keyed_segments(meta)
        pages = -(-kv // ps)
        indices = [
            meta.page_table_host[i, : pages[i]] if live[i] else np.array([SCRATCH_PAGE], np.int32)
            for i in range(s)
        ]
        pad = batch - s  # inert padding segments: no rows, one scratch page each
        qo = np.concatenate([meta.cu_seqlens_q_host, np.full(pad, meta.num_q_rows)])
        counts = np.concatenate([pages, np.ones(pad, np.int64)])
        kv_indptr = np.concatenate([[0], np.cumsum(counts)])
        flat = np.concatenate(indices + [np.full(pad, SCRATCH_PAGE)])
        last = np.concatenate([kv - (pages - 1) * ps, np.ones(pad, np.int64)])
        i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
        return cls(i32(qo), i32(kv_indptr), i32(flat), i32(last))


# its plan buffers are sized by max_segments (two a request under zigzag)
@register_backend("flashinfer", kv_layout="NHD", per_request=True)
class FlashInferAttention(AttentionBackend):
    supports_full_graph = True  # only with prepare() (plan) before every replay
    gpu_kernels = True

    def __init__(
        self,
        spec: AttentionSpec,
        device: torch.device | str = "cuda",
        *,
        max_segments: int,
        max_pages: int,
        max_q_rows: int,
        dtype: torch.dtype = torch.bfloat16,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        flashinfer: ModuleType | None = None,
        workspace: torch.Tensor | None = None,
        staging: PinnedStaging | None = None,
    ) -> None:
        """``workspace``: a float workspace to share (ring steps run one after another);
        None allocates ``workspace_bytes``. ``staging``: the fence between plans (None:
        a CUDA event; tests pass a fake copy engine)."""
        super().__init__(spec)
        if max_segments < 1 or max_q_rows < 1:
            raise ValueError(f"max_segments and max_q_rows must be >= 1, got {max_segments}, {max_q_rows}")
        if max_pages < max_segments:
            raise ValueError(
                f"max_pages={max_pages} < max_segments={max_segments}: every segment needs at least one page"
            )
        fi = flashinfer if flashinfer is not None else import_flashinfer(self.name)
        self.device = dev = torch.device(device)
        self.max_segments, self.max_pages, self.max_q_rows = max_segments, max_pages, max_q_rows
        self.dtype = dtype
        i32 = dict(dtype=torch.int32, device=dev)
        self.workspace = workspace if workspace is not None else torch.empty(workspace_bytes, dtype=torch.uint8,
                                                                             device=dev)
        self.qo_indptr_buf = torch.zeros(max_segments + 1, **i32)
        self.paged_kv_indptr_buf = torch.zeros(max_segments + 1, **i32)
        self.paged_kv_indices_buf = torch.zeros(max_pages, **i32)
        self.paged_kv_last_page_len_buf = torch.zeros(max_segments, **i32)
        self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace,
            spec.kv_layout,
            use_cuda_graph=True,
            qo_indptr_buf=self.qo_indptr_buf,
            paged_kv_indptr_buf=self.paged_kv_indptr_buf,
            paged_kv_indices_buf=self.paged_kv_indices_buf,
            paged_kv_last_page_len_buf=self.paged_kv_last_page_len_buf,
            backend=WRAPPER_BACKEND,
        )
        self._lse = Base2Lse(max_q_rows, dev)
        # plan uploads its schedule from the wrapper's pinned buffer asynchronously: the next
        # plan rewrites that buffer only after the previous upload ran
        self._plan_fence = staging if staging is not None else PinnedStaging(dev)
        self._planned_rows: int | None = None
        self._planned_static = False
        self._planned_causal = True
        self._plan(self._rows_args(max_q_rows))

    def _rows_args(self, rows: int, keys: int = 1) -> PagedPlanArgs:
        """A plan of ``rows`` rows, all in segment 0, over ``keys`` keys on the scratch
        page (repeated). With ``max_q_rows`` rows and one key (planned, never run) it
        fixes the wrapper's row capacity; with a bucket's rows and as many keys it is
        what a full-graph capture and its warm-up run over (every row sees a key)."""
        b, ps = self.max_segments, self.spec.page_size
        pages = -(-keys // ps)
        if pages + b - 1 > self.max_pages:
            raise ValueError(f"a capture plan over {keys} keys needs {pages + b - 1} page entries, more than "
                             f"max_pages={self.max_pages}")
        qo = np.full(b + 1, rows, np.int32)
        qo[0] = 0
        counts = np.ones(b, np.int64)
        counts[0] = pages
        last = np.ones(b, np.int32)
        last[0] = keys - (pages - 1) * ps
        return PagedPlanArgs(
            qo_indptr=qo,
            paged_kv_indptr=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            paged_kv_indices=np.full(pages + b - 1, SCRATCH_PAGE, np.int32),
            paged_kv_last_page_len=last,
        )

    def _plan(self, a: PagedPlanArgs, causal: bool = True) -> None:
        spec = self.spec
        self._plan_fence.wait()
        try:
            self.wrapper.plan(
                torch.from_numpy(a.qo_indptr),
                torch.from_numpy(a.paged_kv_indptr),
                torch.from_numpy(a.paged_kv_indices),
                torch.from_numpy(a.paged_kv_last_page_len),
                spec.num_q_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.page_size,
                causal=causal,
                sm_scale=spec.scale,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
                # in CUDA-graph mode split-KV is always on otherwise, over a grid padded to the row
                # capacity's tiles: tmp_v alone is heads x ~max_q_rows x head_dim x 4 bytes (1.1 GB
                # for an 8B model at 65K rows). A prefill has query tiles enough: no scratch, no merge
                disable_split_kv=True,
            )
        except RuntimeError as e:  # the library's allocator and checks (C++ errors)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"flashinfer plan failed for {int(a.qo_indptr[-1])} query rows (capacity max_q_rows="
                f"{self.max_q_rows}), {self.max_segments} segments, {spec.num_q_heads}/{spec.num_kv_heads} heads "
                f"x {spec.head_dim}, float workspace {self.workspace.numel() * self.workspace.element_size()} B: "
                f"{first}") from e
        self._plan_fence.mark()

    def prepare(self, meta: AttentionMetadata, requests: BatchRequests | None = None) -> None:
        if meta.page_size != self.spec.page_size:
            raise ValueError(f"metadata page_size {meta.page_size} != spec page_size {self.spec.page_size}")
        if meta.static:
            # a full-graph capture: q is the bucket's rows (max_q_len), replays read later plans
            if not 1 <= meta.max_q_len <= self.max_q_rows:
                raise ValueError(f"static metadata bounds {meta.max_q_len} query rows; expected 1..max_q_rows="
                                 f"{self.max_q_rows}")
            self._plan(self._rows_args(meta.max_q_len, keys=meta.max_q_len))
            self._planned_rows, self._planned_static, self._planned_causal = meta.max_q_len, True, True
            return
        if meta.num_q_rows > self.max_q_rows:
            raise ValueError(f"metadata has {meta.num_q_rows} query rows, more than max_q_rows={self.max_q_rows}")
        args = PagedPlanArgs.build(meta, self.max_segments)
        if args.paged_kv_indices.shape[0] > self.max_pages:
            raise ValueError(
                f"plan needs {args.paged_kv_indices.shape[0]} page entries (pages of live segments plus "
                f"one per empty segment), more than max_pages={self.max_pages}"
            )
        self._plan(args, meta.causal)
        self._planned_rows, self._planned_static, self._planned_causal = meta.num_q_rows, False, meta.causal

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        n = meta.kernel_rows
        if self._planned_rows != n or self._planned_static != meta.static or self._planned_causal != meta.causal:
            raise RuntimeError(
                f"flashinfer backend: prepare(meta) must run before forward for this metadata "
                f"(planned rows {self._planned_rows}, metadata rows {n}{', static' if meta.static else ''})"
            )
        if q.dtype != self.dtype or kv_cache.dtype != self.dtype:
            raise ValueError(f"flashinfer backend was planned for {self.dtype}, got q {q.dtype}, kv {kv_cache.dtype}")
        if meta.static and q.shape[0] != n:
            raise ValueError(f"full-graph capture: q has {q.shape[0]} rows, the static metadata bounds {n} "
                             "(the bucket's rows)")
        if n == 0:
            return  # no rows, no launch
        if lse is None:
            self.wrapper.run(q[:n], kv_cache, out=out[:n])
        else:
            self.wrapper.run(q[:n], kv_cache, out=out[:n], lse=lse[:n], return_lse=True)
            self._lse.to_base_e(lse, meta.cu_seqlens_q)
        write_no_key_rows(meta, out, lse)
