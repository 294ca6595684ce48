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
- ``cum_seq_lens_q``: ``cu_seqlens_q``, ending at the real row count;
- a segment with ``q_len == 0`` is inert: ``seq_len = 1`` on the scratch page (no
  query rows means no work, and no kernel sees an empty kv range).

Rows. The launcher takes the query row count from ``query.size(0)``
(``sum_seq_q``) and its LSE pass writes *every* one of those rows, rows past
``cum_seq_lens_q[batch_size]`` from stale workspace statistics. So an eager
call (live metadata) passes ``q``/``out``/``lse`` sliced to the live rows, and
makes no call at all when there are none (``batch_size = 0`` is no launch
anyone needs).

Counters. trtllm-gen's multi-CTA mode keeps semaphores in a separate counter
buffer; FlashInfer allocates and zeroes a fresh one for every call that does
not pass ``multi_ctas_kv_counter_buffer``. The backend owns one, zeroed once
(the kernel resets its counters after each launch), sized for
``max(max_segments * num_q_heads, sm_count)`` counters.

Graphs. ``max_q_len``/``max_kv_len``/``batch_size`` are host integers baked into
a captured launch. With ``static_max_q_len`` and ``static_max_kv_len`` the
backend supports full-graph mode: the grid is sized for those maxima, the
batch is always ``max_segments`` long (the live segments, then inert padding
segments, so a replay for fewer segments reads a valid batch, never what an
earlier plan left behind), and a capture (static metadata) passes the whole
``q``; its LSE goes to a scratch buffer and only live rows are copied out, on
the device. Without them the lengths follow each batch and the backend runs
eagerly (breakable graphs).

Scales: ``bmm1_scale = spec.scale`` (no fp8 q/k scales), ``bmm2_scale = 1``.
Non-causal metadata (ring steps, always live) is passed as ``causal=False``
(FlashInfer 0.7.4's signature has it); segments whose rows see no key get the
inert scratch key and then the contract's output 0 and LSE -inf.

Workspace. Whenever LSE is requested the launcher carves softmax statistics from the
float workspace: ``heads x batch_size x round_up(max_q_len, 256)`` float2 plus a 1 MiB
guard (``trtllm_fmha_kernel_launcher.cu``); 64 heads x 16 segments x 32K rows is 268 MB,
past the default 128 MiB. ``forward`` grows the workspace (zeroed) to
:func:`lse_stats_bytes` of the planned batch before such a call; inside a graph capture
it cannot, and says so (a :class:`~graphcp.errors.ConfigError` naming the sizes).

The cache must be HND with pages of 16, 32 or 64 tokens. The kernel's LSE is
base 2 (``ComputeLSEFromMD`` writes ``log2e * m + log2(d)``); it is converted
to base e on the device (see :class:`Base2Lse`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch

from graphcp.attention.backends.flashinfer import (
    DEFAULT_WORKSPACE_BYTES,
    LN2,
    Base2Lse,
    import_flashinfer,
    keyed_segments,
    write_no_key_rows,
)
from graphcp.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec, BatchRequests
from graphcp.attention.catalog import register_backend
from graphcp.errors import ConfigError
from graphcp.kv.page_table import SCRATCH_PAGE

SUPPORTED_CAPABILITIES = ((10, 0), (10, 3))
SUPPORTED_PAGE_SIZES = (16, 32, 64)
#: the pad trtllm-gen adds after its softmax statistics (``kTrtllmGenSoftmaxStatsGuardBytes``)
LSE_STATS_GUARD_BYTES = 1 << 20


def lse_stats_bytes(num_q_heads: int, batch_size: int, max_q_len: int) -> int:
    """Workspace bytes a call that returns LSE takes for softmax statistics: ``heads x
    batch x round_up(max_q_len, 256)`` float2 plus the guard (the launcher's formula;
    the first carve of the workspace, so its 16-byte alignment costs nothing)."""
    return 8 * num_q_heads * batch_size * (-(-max_q_len // 256) * 256) + LSE_STATS_GUARD_BYTES


def counter_buffer_bytes(batch_size: int, num_q_heads: int, sm_count: int) -> int:
    """Bytes of trtllm-gen's multi-CTA KV counters (``round_up(max(batch * heads,
    SMs), 8)`` 32-bit semaphores, as ``get_trtllm_gen_multi_ctas_kv_counter_bytes``)."""
    return -(-max(batch_size * num_q_heads, sm_count) // 8) * 8 * 4


def check_capability(capability: tuple[int, int], where: str = "this GPU") -> None:
    if tuple(capability) not in SUPPORTED_CAPABILITIES:
        major, minor = capability
        need = ", ".join(f"SM{a}{b}" for a, b in SUPPORTED_CAPABILITIES)
        raise RuntimeError(
            f"the 'trtllm' attention backend (trtllm-gen context FMHA) needs a Blackwell GPU with "
            f"compute capability {need}; {where} is SM{major}{minor} (capability {major}.{minor}). "
            "Use the 'flashinfer' or 'triton' backend instead."
        )


# trtllm-gen reads only an HND cache; its block tables and counters are sized by max_segments
@register_backend("trtllm", kv_layout="HND", per_request=True)
class TrtllmAttention(AttentionBackend):
    supports_full_graph = False  # per instance: True with static max lengths
    gpu_kernels = True

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
        sm_count: int | None = None,
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
        self._has_causal = _accepts(self._run, "causal")

        self.max_segments, self.max_pages_per_segment = max_segments, max_pages_per_segment
        self.static_max_q_len, self.static_max_kv_len = static_max_q_len, static_max_kv_len
        self.static = static_max_q_len is not None
        self.supports_full_graph = self.static
        i32 = dict(dtype=torch.int32, device=dev)
        # trtllm-gen keeps counters in the workspace and expects them zeroed at allocation
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=dev)
        # one persistent multi-CTA counter buffer (older FlashInfer keeps them in the workspace)
        self.counters = None
        if _accepts(self._run, "multi_ctas_kv_counter_buffer"):
            if sm_count is None:
                if dev.type != "cuda":
                    raise ValueError(f"sm_count is needed to size the counter buffer off CUDA (device {dev})")
                sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
            self.counters = torch.zeros(counter_buffer_bytes(max_segments, spec.num_q_heads, sm_count),
                                        dtype=torch.uint8, device=dev)
        self.block_tables = torch.zeros(max_segments, max_pages_per_segment, **i32)
        self.seq_lens = torch.zeros(max_segments, **i32)
        self.cum_seq_lens_q = torch.zeros(max_segments + 1, **i32)
        self.cum_seq_lens_kv = torch.zeros(max_segments + 1, **i32)
        self._lse = Base2Lse(max_q_rows, dev)
        # a capture's LSE lands here first: the kernel writes all of q's rows
        self._lse_scratch = torch.zeros(max_q_rows, spec.num_q_heads, dtype=torch.float32, device=dev) \
            if self.static else None
        self._batch: tuple[int, int, int] | None = None  # (batch_size, max_q_len, max_kv_len)
        self._planned: tuple[int, bool, bool] | None = None  # (rows, static metadata, causal)

    def prepare(self, meta: AttentionMetadata, requests: BatchRequests | None = None) -> None:
        s, width = meta.num_segments, meta.page_table_host.shape[1]
        if meta.page_size != self.spec.page_size:
            raise ValueError(f"metadata page_size {meta.page_size} != spec page_size {self.spec.page_size}")
        if s > self.max_segments:
            raise ValueError(f"metadata has {s} segments, the backend was built for max_segments={self.max_segments}")
        if meta.static and not self.static:
            raise ValueError("static (full-graph) metadata needs a trtllm backend built with static_max_q_len and "
                             "static_max_kv_len")
        # static metadata: host arrays are bounds only; every segment of the capture is inert
        live = keyed_segments(meta) if not meta.static else np.zeros(s, bool)
        seq = np.where(live, meta.kv_lens_host, 1).astype(np.int32)
        pages_needed = int((-(-meta.kv_lens_host[live] // meta.page_size)).max(initial=0))
        if pages_needed > self.max_pages_per_segment:
            raise ValueError(
                f"a segment needs {pages_needed} pages, the block table has max_pages_per_segment="
                f"{self.max_pages_per_segment}"
            )
        cu = meta.cu_seqlens_q_host if not meta.static else np.zeros(s + 1, np.int32)
        max_q = int(np.diff(cu).max(initial=0)) if not meta.static else 0
        max_kv = int(seq.max(initial=1))
        b = s
        if self.static:
            if max_q > self.static_max_q_len or max_kv > self.static_max_kv_len:
                raise ValueError(
                    f"batch has max_q_len={max_q}, max_kv_len={max_kv}; the backend was built for "
                    f"static_max_q_len={self.static_max_q_len}, static_max_kv_len={self.static_max_kv_len}"
                )
            max_q, max_kv, b = self.static_max_q_len, self.static_max_kv_len, self.max_segments
        max_q = max(max_q, 1)
        # the batch: live segments, then inert ones (no rows, one key on the scratch page) up to b
        table = np.full((b, self.max_pages_per_segment), SCRATCH_PAGE, np.int32)
        w = min(width, self.max_pages_per_segment)
        table[:s, :w] = np.where(live[:, None], meta.page_table_host[:, :w], SCRATCH_PAGE)
        seq_b = np.ones(b, np.int32)
        seq_b[:s] = seq
        cu_b = np.full(b + 1, cu[-1], np.int32)
        cu_b[: s + 1] = cu
        self._upload(self.block_tables[:b], table)
        self._upload(self.seq_lens[:b], seq_b)
        self._upload(self.cum_seq_lens_q[: b + 1], cu_b)
        self._upload(self.cum_seq_lens_kv[: b + 1], np.concatenate([[0], np.cumsum(seq_b)]))
        self._batch = (b, max_q, max_kv)
        self._planned = (meta.kernel_rows, meta.static, meta.causal)

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
        rows = meta.kernel_rows
        if self._batch is None or self._planned != (rows, meta.static, meta.causal):
            raise RuntimeError("trtllm backend: prepare(meta) must run before forward for this metadata")
        if not meta.causal and not self._has_causal:
            raise NotImplementedError("the installed FlashInfer's trtllm_batch_context_with_kv_cache has no `causal` "
                                      "argument; ring steps (non-causal) need a newer flashinfer")
        if lse is not None and not self._has_lse:
            raise NotImplementedError(
                "the installed FlashInfer's trtllm_batch_context_with_kv_cache has no `lse` output; "
                "upgrade flashinfer to get LSE from the trtllm backend"
            )
        if meta.static:
            if q.shape[0] != rows:
                raise ValueError(f"full-graph capture: q has {q.shape[0]} rows, the static metadata bounds {rows}")
            # the whole q: the captured launch serves every replay; LSE through the scratch
            kernel_lse = None if lse is None else self._lse_scratch[: q.shape[0]]
            if kernel_lse is not None:
                self._reserve_lse_stats()
            self._call(q, kv_cache, out, kernel_lse)
            if lse is not None:
                self._lse.copy_live_base_e(kernel_lse, lse, self.cum_seq_lens_q)
            return
        if rows == 0:
            return  # no rows, no launch
        lse_n = None if lse is None else lse[:rows]
        if lse_n is not None:
            self._reserve_lse_stats()
        self._call(q[:rows], kv_cache, out[:rows], lse_n, meta.causal)
        if lse_n is not None:
            lse_n.mul_(LN2)  # every row of the slice is live: base 2 -> base e
        write_no_key_rows(meta, out, lse)

    def _reserve_lse_stats(self) -> None:
        """Grow the workspace (zeroed, as trtllm-gen expects) to hold the planned batch's
        softmax statistics, before a call that returns LSE."""
        b, max_q, _ = self._batch
        need = lse_stats_bytes(self.spec.num_q_heads, b, max_q)
        have = self.workspace.numel()
        if need <= have:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ConfigError(
                f"trtllm: LSE statistics for {b} segments x max_q_len {max_q} x {self.spec.num_q_heads} heads need "
                f"{need} B of workspace, it has {have} B, and a graph capture cannot grow it (build the backend "
                f"with workspace_bytes >= {need})")
        self.workspace = torch.zeros(need, dtype=torch.uint8, device=self.device)

    def _call(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
              causal: bool = True) -> None:
        b, max_q, max_kv = self._batch
        kw = dict(window_left=-1, out=out)
        if not causal:
            kw["causal"] = False
        if lse is not None:
            kw.update(lse=lse, return_lse=True)
        if self.counters is not None:
            kw["multi_ctas_kv_counter_buffer"] = self.counters
        self._run(
            query=q,
            kv_cache=kv_cache,
            workspace_buffer=self.workspace,
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            max_q_len=max_q,
            max_kv_len=max_kv,
            bmm1_scale=self.spec.scale,
            bmm2_scale=1.0,
            batch_size=b,
            cum_seq_lens_q=self.cum_seq_lens_q[: b + 1],
            cum_seq_lens_kv=self.cum_seq_lens_kv[: b + 1],
            **kw,
        )


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # not introspectable: assume a current version
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
