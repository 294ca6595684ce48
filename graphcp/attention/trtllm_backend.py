"""``trtllm``: FlashInfer's trtllm-gen context FMHA
(``flashinfer.prefill.trtllm_batch_context_with_kv_cache``), Blackwell only
(SM100 / SM103).

One kernel call per layer covers every segment: the batch is the metadata's
segment list (for zigzag, the early and late segment of every request: 2 x
requests). ``prepare(meta)`` writes the device arguments into preallocated
buffers from the host copy of the metadata:

- ``block_tables[s]``: the segment's page-table row (width ``max_pages_per_segment``,
  zero-padded: the scratch page, never read);
- ``seq_lens[s]``: the segment's kv length; ``cum_seq_lens_kv``: their prefix sums
  (token counts, as the docstring says: "cumulative sequence length for
  kv_cache"; FlashInfer's own wrapper passes page counts there, which suggests
  the paged kernel does not read it);
- ``cum_seq_lens_q``: ``cu_seqlens_q``, ending at the real row count, so padding
  rows of ``q`` belong to no sequence and are never written. ``q``/``out``/``lse``
  are passed whole: their static shapes size the kernel's TMA descriptors, so a
  captured launch covers every row count up to the capacity;
- a segment with ``q_len == 0`` is inert: ``seq_len = 1`` on the scratch page (no
  query rows means no work, and no kernel sees an empty kv range).

``max_q_len``/``max_kv_len``/``batch_size`` are host integers baked into a
captured launch; with ``static_max_q_len`` and ``static_max_kv_len`` given they are
fixed (the grid is sized for the worst case) and the backend supports full-graph
mode; without them they follow each batch and the backend must run eagerly.

Scales: ``bmm1_scale = spec.scale`` (no fp8 q/k scales), ``bmm2_scale = 1``.
The cache must be HND with pages of 16, 32 or 64 tokens. The kernel's LSE is
taken to be base 2 like FlashInfer's other kernels (trtllm-gen runs its softmax
in exp2); it is converted to base e on the device (see :class:`Base2Lse`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch

from graphcp.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec
from graphcp.attention.flashinfer_backend import (
    DEFAULT_WORKSPACE_BYTES,
    Base2Lse,
    effective_kv_lens,
    import_flashinfer,
)
from graphcp.kvcache import SCRATCH_PAGE

SUPPORTED_CAPABILITIES = ((10, 0), (10, 3))
SUPPORTED_PAGE_SIZES = (16, 32, 64)


def check_capability(capability: tuple[int, int], where: str = "this GPU") -> None:
    if tuple(capability) not in SUPPORTED_CAPABILITIES:
        major, minor = capability
        need = ", ".join(f"SM{a}{b}" for a, b in SUPPORTED_CAPABILITIES)
        raise RuntimeError(
            f"the 'trtllm' attention backend (trtllm-gen context FMHA) needs a Blackwell GPU with "
            f"compute capability {need}; {where} is SM{major}{minor} (capability {major}.{minor}). "
            "Use the 'flashinfer' or 'triton' backend instead."
        )


class TrtllmAttention(AttentionBackend):
    name = "trtllm"
    supports_full_graph = False  # per instance: True with static max lengths

    def __init__(
        self,
        spec: AttentionSpec,
        device: torch.device | str = "cuda",
        *,
        max_segments: int,
        max_pages_per_segment: int,
        max_q_rows: int,
        static_max_q_len: int | None = None,
        static_max_kv_len: int | None = None,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        capability: Callable[[], tuple[int, int]] | None = None,
        flashinfer: ModuleType | None = None,
    ) -> None:
        super().__init__(spec)
        if spec.kv_layout != "HND":
            raise ValueError(f"trtllm backend needs an HND kv cache, the spec says {spec.kv_layout!r}")
        if spec.page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(f"trtllm backend needs page_size in {SUPPORTED_PAGE_SIZES}, got {spec.page_size}")
        if min(max_segments, max_pages_per_segment, max_q_rows) < 1:
            raise ValueError(
                "max_segments, max_pages_per_segment and max_q_rows must be >= 1, got "
                f"{max_segments}, {max_pages_per_segment}, {max_q_rows}"
            )
        if (static_max_q_len is None) != (static_max_kv_len is None):
            raise ValueError("give both static_max_q_len and static_max_kv_len, or neither")
        self.device = dev = torch.device(device)
        if capability is None:
            if dev.type != "cuda":
                raise RuntimeError(f"the 'trtllm' attention backend needs a CUDA device, got {dev}")
            capability = lambda: torch.cuda.get_device_capability(dev)  # noqa: E731
        check_capability(tuple(capability()), where=str(dev))
        if flashinfer is not None:
            self._run = flashinfer.prefill.trtllm_batch_context_with_kv_cache
        else:
            self._run = import_flashinfer(self.name, "prefill").trtllm_batch_context_with_kv_cache
        self._has_lse = _accepts(self._run, "lse")

        self.max_segments, self.max_pages_per_segment = max_segments, max_pages_per_segment
        self.static_max_q_len, self.static_max_kv_len = static_max_q_len, static_max_kv_len
        self.supports_full_graph = static_max_q_len is not None
        i32 = dict(dtype=torch.int32, device=dev)
        # trtllm-gen keeps counters in the workspace and expects them zeroed at allocation
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=dev)
        self.block_tables = torch.zeros(max_segments, max_pages_per_segment, **i32)
        self.seq_lens = torch.zeros(max_segments, **i32)
        self.cum_seq_lens_q = torch.zeros(max_segments + 1, **i32)
        self.cum_seq_lens_kv = torch.zeros(max_segments + 1, **i32)
        self._lse = Base2Lse(max_q_rows, dev)
        self._batch: tuple[int, int, int] | None = None  # (batch_size, max_q_len, max_kv_len)
        self._planned_rows: int | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        s, width = meta.num_segments, meta.page_table_host.shape[1]
        if meta.page_size != self.spec.page_size:
            raise ValueError(f"metadata page_size {meta.page_size} != spec page_size {self.spec.page_size}")
        if s > self.max_segments:
            raise ValueError(f"metadata has {s} segments, the backend was built for max_segments={self.max_segments}")
        live = meta.q_lens_host > 0
        seq = effective_kv_lens(meta)
        pages_needed = int((-(-meta.kv_lens_host[live] // meta.page_size)).max(initial=0))
        if pages_needed > self.max_pages_per_segment:
            raise ValueError(
                f"a segment needs {pages_needed} pages, the block table has max_pages_per_segment="
                f"{self.max_pages_per_segment}"
            )
        table = np.full((s, self.max_pages_per_segment), SCRATCH_PAGE, np.int32)
        w = min(width, self.max_pages_per_segment)
        table[:, :w] = np.where(live[:, None], meta.page_table_host[:, :w], SCRATCH_PAGE)
        max_q = max(meta.max_q_len, 1)
        max_kv = int(seq.max(initial=1))
        if self.static_max_q_len is not None:
            if max_q > self.static_max_q_len or max_kv > self.static_max_kv_len:
                raise ValueError(
                    f"batch has max_q_len={max_q}, max_kv_len={max_kv}; the backend was built for "
                    f"static_max_q_len={self.static_max_q_len}, static_max_kv_len={self.static_max_kv_len}"
                )
            max_q, max_kv = self.static_max_q_len, self.static_max_kv_len
        self._upload(self.block_tables[:s], table)
        self._upload(self.seq_lens[:s], seq)
        self._upload(self.cum_seq_lens_q[: s + 1], meta.cu_seqlens_q_host)
        self._upload(self.cum_seq_lens_kv[: s + 1], np.concatenate([[0], np.cumsum(seq)]))
        self._batch = (s, max_q, max_kv)
        self._planned_rows = meta.num_q_rows

    @staticmethod
    def _upload(dst: torch.Tensor, src: np.ndarray) -> None:
        dst.copy_(torch.from_numpy(np.ascontiguousarray(src, dtype=np.int32)))

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        if self._batch is None or self._planned_rows != meta.num_q_rows or self._batch[0] != meta.num_segments:
            raise RuntimeError("trtllm backend: prepare(meta) must run before forward for this metadata")
        if lse is not None and not self._has_lse:
            raise NotImplementedError(
                "the installed FlashInfer's trtllm_batch_context_with_kv_cache has no `lse` output; "
                "upgrade flashinfer to get LSE from the trtllm backend"
            )
        s, max_q, max_kv = self._batch
        kw = dict(window_left=-1, out=out)
        if lse is not None:
            kw.update(lse=lse, return_lse=True)
        self._run(
            query=q,
            kv_cache=kv_cache,
            workspace_buffer=self.workspace,
            block_tables=self.block_tables[:s],
            seq_lens=self.seq_lens[:s],
            max_q_len=max_q,
            max_kv_len=max_kv,
            bmm1_scale=self.spec.scale,
            bmm2_scale=1.0,
            batch_size=s,
            cum_seq_lens_q=self.cum_seq_lens_q[: s + 1],
            cum_seq_lens_kv=self.cum_seq_lens_kv[: s + 1],
            **kw,
        )
        if lse is not None:
            self._lse.to_base_e(lse, meta.cu_seqlens_q)


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # not introspectable: assume a current version
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
