"""``flashinfer``'s decode kernel: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``,
what a decode graph captures when the engine's attention backend is ``flashinfer``.

What the wrapper bakes in and when (flashinfer-python 0.7.4, ``decode.py``):

- ``use_cuda_graph=True`` fixes the batch size at the first ``plan`` (``len(indptr) - 1``
  must equal the buffers' batch at every plan): one wrapper a decode bucket (its rows),
  made on the bucket's first plan, with fixed ``indptr`` ``[rows + 1]``, ``last_page_len``
  ``[rows]`` and ``indices`` ``[rows x width]`` device buffers (the page table's width:
  the most pages a bucket's row can hold), sharing one zeroed float workspace;
- ``plan`` runs on the host before every replay (``plans_steps``): it copies ``indptr``
  and ``last_page_len`` into the buffers with ``non_blocking=True`` and reads them on the
  host for its schedule, so they are pinned host tensors the next plan rewrites only
  after the copies ran (a fence, as the prefill wrapper's); it copies ``indices``
  without blocking only when they are on the device already, so they are uploaded first
  (graphcp.attention.staging.to_device);
- ``backend="fa2"`` without tensor cores: the CUDA-core decode kernel (``auto`` may pick
  cuDNN or XQA by shape, and a graph keeps the route of its first plan).

Rows: a row with no key (a rank that holds none of a request, a bucket's padding row)
is planned as one key on the scratch page (a plan needs at least one a row: ``(pages -
1) x page_size + last_page_len``), and after ``run`` its output is set to 0 and its LSE
to -inf on the device, from the bucket's lengths (no host read, so the fix is captured
too). The wrapper's LSE is base 2 (FlashInfer's convention, as its prefill's): multiplied
by ln 2 before the merge.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from graphcp.attention.backends.flashinfer import DEFAULT_WORKSPACE_BYTES, LN2, import_flashinfer
from graphcp.attention.base import AttentionMetadata, AttentionSpec, DecodeKernel
from graphcp.attention.catalog import register_decode_backend
from graphcp.attention.staging import PinnedStaging, to_device
from graphcp.kv.page_table import SCRATCH_PAGE

#: the decode wrapper's kernels: FA2's CUDA-core decode (the route a graph keeps)
WRAPPER_BACKEND = "fa2"


def decode_plan_args(kv_lens: np.ndarray, table: np.ndarray, page_size: int, rows: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(indptr [rows + 1], indices, last_page_len [rows])`` int32 for the wrapper's plan:
    the segments' pages (``kv_lens`` [S], ``table`` [S, width]), then ``rows - S`` padding
    rows; a row with no key gets one scratch page holding one key."""
    s = kv_lens.shape[0]
    keyed = kv_lens > 0
    pages = np.where(keyed, -(-kv_lens // page_size), 1).astype(np.int64)
    counts = np.concatenate([pages, np.ones(rows - s, np.int64)])
    indptr = np.zeros(rows + 1, np.int32)
    indptr[1:] = np.cumsum(counts)
    within = np.arange(table.shape[1])[None, :] < pages[:, None]
    live = np.where(keyed[:, None], table, SCRATCH_PAGE)[within]
    indices = np.concatenate([live, np.full(rows - s, SCRATCH_PAGE)]).astype(np.int32)
    last = np.concatenate([np.where(keyed, kv_lens - (pages - 1) * page_size, 1), np.ones(rows - s, np.int64)])
    return indptr, indices, last.astype(np.int32)


@dataclass
class _BucketWrapper:
    """One bucket's wrapper, its fixed device buffers and its pinned plan inputs."""

    wrapper: object
    indptr: torch.Tensor  # pinned host [rows + 1]
    last: torch.Tensor  # pinned host [rows]
    fence: PinnedStaging


@register_decode_backend("flashinfer")
class FlashInferDecodeAttention(DecodeKernel):
    """See the module doc."""

    name = "flashinfer-decode"
    gpu_kernels = True
    plans_steps = True
    any_batch = False  # one wrapper a batch size, fixed at its first plan

    def __init__(self, spec: AttentionSpec, device: torch.device | str = "cuda", *, max_pages_per_segment: int,
                 dtype: torch.dtype = torch.bfloat16, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
                 flashinfer: ModuleType | None = None, staging=None) -> None:
        """``staging``: makes each bucket's pinned buffers and fence (None: CUDA's; tests
        pass a fake copy engine)."""
        super().__init__(spec)
        self._fi = flashinfer if flashinfer is not None else import_flashinfer("flashinfer")
        self.device = torch.device(device)
        self.width, self.dtype, self._staging = max_pages_per_segment, dtype, staging
        # "Must be initialized to 0 for its first use" (the wrapper's docstring)
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._buckets: dict[int, _BucketWrapper] = {}
        self._rows: int | None = None
        self._planned: tuple[int, bool] | None = None  # (rows, static) of the latest plan

    def bucket(self, rows: int) -> None:
        self._rows = rows

    def _bucket(self, rows: int) -> _BucketWrapper:
        got = self._buckets.get(rows)
        if got is None:
            i32 = dict(dtype=torch.int32, device=self.device)
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, self.spec.kv_layout, use_cuda_graph=True, use_tensor_cores=False,
                paged_kv_indptr_buffer=torch.zeros(rows + 1, **i32),
                paged_kv_indices_buffer=torch.zeros(rows * self.width, **i32),
                paged_kv_last_page_len_buffer=torch.zeros(rows, **i32), backend=WRAPPER_BACKEND)
            fence = self._staging if self._staging is not None else PinnedStaging(self.device)
            host = fence.host if self.device.type == "cuda" or self._staging is not None else _plain_host
            got = self._buckets[rows] = _BucketWrapper(wrapper, host(rows + 1, torch.int32), host(rows, torch.int32),
                                                       fence)
        return got

    def prepare(self, meta: AttentionMetadata) -> None:
        """Plan the bucket's rows: a capture's (static metadata: every row inert) or a step's."""
        rows = self._rows if self._rows is not None else meta.num_segments
        if meta.num_segments > rows:
            raise ValueError(f"a decode step of {meta.num_segments} requests planned on a bucket of {rows} rows")
        if meta.page_table_host.shape[1] > self.width:
            raise ValueError(f"a page table of {meta.page_table_host.shape[1]} pages, the decode kernel was built for "
                             f"{self.width}")
        b = self._bucket(rows)
        indptr, indices, last = decode_plan_args(meta.kv_lens_host, meta.page_table_host, meta.page_size, rows)
        b.fence.wait()  # the previous plan's copies read these pinned buffers when they run
        b.indptr.numpy()[:] = indptr
        b.last.numpy()[:] = last
        spec = self.spec
        b.wrapper.plan(b.indptr, to_device(indices, self.device), b.last, spec.num_q_heads,
                       spec.num_kv_heads, spec.head_dim, spec.page_size, q_data_type=self.dtype,
                       kv_data_type=self.dtype, sm_scale=spec.scale, non_blocking=True)
        b.fence.mark()
        self._planned = (rows, meta.static)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor,
                lse: torch.Tensor | None = None) -> None:
        rows = meta.kv_lens.shape[0]
        if self._planned is None or self._planned[0] != rows:
            raise RuntimeError(f"flashinfer decode: prepare must plan the bucket of {rows} rows before forward "
                               f"(planned: {self._planned})")
        if q.dtype != self.dtype or kv_cache.dtype != self.dtype:
            raise ValueError(f"flashinfer decode was built for {self.dtype}, got q {q.dtype}, kv {kv_cache.dtype}")
        wrapper = self._buckets[rows].wrapper
        o = out[:rows]
        if lse is None:
            wrapper.run(q[:rows], kv_cache, out=o)
        else:
            lse_rows = lse[:rows]
            wrapper.run(q[:rows], kv_cache, out=o, lse=lse_rows, return_lse=True)
            lse_rows.mul_(LN2)  # base 2 -> base e
        write_keyless_rows(meta.kv_lens, o, None if lse is None else lse[:rows])


def write_keyless_rows(kv_lens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """Rows with no key (``kv_lens == 0``, read on the device): output 0, LSE -inf, over what
    a kernel computed for them against the inert scratch key."""
    none = kv_lens == 0
    out.masked_fill_(none[:, None, None], 0)
    if lse is not None:
        lse.masked_fill_(none[:, None], float("-inf"))


def _plain_host(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)
