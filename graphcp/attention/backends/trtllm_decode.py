"""``trtllm``'s decode kernel: trtllm-gen's generation FMHA
(``flashinfer.decode.trtllm_batch_decode_with_kv_cache``), what a decode graph captures
when the engine's attention backend is ``trtllm`` (Blackwell, an HND cache).

One call a layer over the bucket's static device buffers: ``block_tables`` is the
bucket's page table ``[rows, width]`` (copied on the device into a contiguous buffer: the
launcher takes a row's stride from ``block_tables.size(-1)``, and a bucket's table is a
view of the widest one) and ``seq_lens`` its lengths, both read by the kernel when it
runs; the host integers baked into a captured launch are the bucket's
(``max_seq_len`` = width x page size, the batch = ``q``'s rows, ``q_len_per_req`` = 1).
A row with no key gets ``seq_len`` 1 (on its table's zeros: the scratch page), computed
on the device into a buffer of the backend's, and then output 0 and LSE -inf.

What it takes, read in flashinfer-python 0.7.4 (``decode.py``,
``trtllm_fmha_kernel_launcher.cu``): with ``return_lse`` the launcher carves softmax
statistics of ``heads x batch x round_up(1, 256)`` float2 plus a 1 MiB guard from the
workspace (sized here for the largest bucket at construction: a capture cannot grow it);
without ``multi_ctas_kv_counter_buffer`` every call allocates and zeroes a fresh counter
buffer (the backend owns one, zeroed once: the kernel resets its counters); the LSE it
writes is base 2 ("LSE is FP32 base-2, matching the existing TRT-LLM"; ``lse_scale``
1.0): multiplied by ln 2 before the merge.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from graphcp.attention.backends.flashinfer import DEFAULT_WORKSPACE_BYTES, LN2, import_flashinfer
from graphcp.attention.backends.flashinfer_decode import write_keyless_rows
from graphcp.attention.backends.trtllm import (
    SUPPORTED_PAGE_SIZES,
    check_capability,
    counter_buffer_bytes,
    lse_stats_bytes,
)
from graphcp.attention.base import AttentionMetadata, AttentionSpec, DecodeKernel
from graphcp.attention.catalog import register_decode_backend

#: the kernels asked for (``auto`` picks XQA off Blackwell, which returns no LSE)
KERNEL_BACKEND = "trtllm-gen"


@register_decode_backend("trtllm")
class TrtllmDecodeAttention(DecodeKernel):
    """See the module doc."""

    name = "trtllm-decode"
    gpu_kernels = True
    any_batch = False  # buffers sized for the largest bucket

    def __init__(self, spec: AttentionSpec, device: torch.device | str = "cuda", *, max_segments: int,
                 max_pages_per_segment: int, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
                 capability: Callable[[], tuple[int, int]] | None = None, sm_count: int | None = None,
                 flashinfer: ModuleType | None = None) -> None:
        super().__init__(spec)
        if spec.kv_layout != "HND":
            raise ValueError(f"trtllm decode needs an HND kv cache, the spec says {spec.kv_layout!r}")
        if spec.page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(f"trtllm decode needs page_size in {SUPPORTED_PAGE_SIZES}, got {spec.page_size}")
        self.device = dev = torch.device(device)
        if capability is None:
            if dev.type != "cuda":
                raise RuntimeError(f"the 'trtllm' decode kernel needs a CUDA device, got {dev}")
            capability = lambda: torch.cuda.get_device_capability(dev)  # noqa: E731
        check_capability(tuple(capability()), where=str(dev))
        if sm_count is None:
            if dev.type != "cuda":
                raise ValueError(f"sm_count is needed to size the counter buffer off CUDA (device {dev})")
            sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
        decode = flashinfer.decode if flashinfer is not None else import_flashinfer("trtllm", "decode")
        self._run = decode.trtllm_batch_decode_with_kv_cache
        # zeroed: trtllm-gen keeps counters in it; large enough for the largest bucket's LSE statistics
        need = lse_stats_bytes(spec.num_q_heads, max_segments, 1)
        self.workspace = torch.zeros(max(workspace_bytes, need), dtype=torch.uint8, device=dev)
        self.counters = torch.zeros(counter_buffer_bytes(max_segments, spec.num_q_heads, sm_count),
                                    dtype=torch.uint8, device=dev)
        self._seq_lens = torch.zeros(max_segments, dtype=torch.int32, device=dev)
        self._tables = torch.zeros(max_segments * max_pages_per_segment, dtype=torch.int32, device=dev)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor,
                lse: torch.Tensor | None = None) -> None:
        rows, (_, width) = meta.kv_lens.shape[0], meta.page_table.shape
        if rows > self._seq_lens.shape[0] or rows * width > self._tables.shape[0]:
            raise ValueError(f"a decode bucket of {rows} rows x {width} pages; the kernel was built for "
                             f"{self._seq_lens.shape[0]} x {self._tables.shape[0] // self._seq_lens.shape[0]}")
        seq, table = self._seq_lens[:rows], self._tables[: rows * width].view(rows, width)
        torch.clamp(meta.kv_lens, min=1, out=seq)  # a row with no key: one inert key (fixed below)
        table.copy_(meta.page_table)
        o = out[:rows]
        kw = {} if lse is None else dict(lse=lse[:rows], return_lse=True)
        self._run(query=q[:rows], kv_cache=kv_cache, workspace_buffer=self.workspace, block_tables=table,
                  seq_lens=seq, max_seq_len=table.shape[1] * self.spec.page_size, bmm1_scale=self.spec.scale,
                  bmm2_scale=1.0, out=o, kv_layout="HND", backend=KERNEL_BACKEND,
                  multi_ctas_kv_counter_buffer=self.counters, **kw)
        if lse is not None:
            lse[:rows].mul_(LN2)  # base 2 -> base e
        write_keyless_rows(meta.kv_lens, o, None if lse is None else lse[:rows])
