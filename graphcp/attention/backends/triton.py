"""``triton``: our own paged prefill kernel (see :mod:`graphcp.attention.kernels.paged_prefill`).

It reads every piece of metadata from device tensors and sizes its grid from the
static row capacity of ``q``, so it can run inside a captured graph
(``supports_full_graph``). ``prepare`` has nothing to do. Tile and warp settings
come per head_dim and dtype from :mod:`graphcp.attention.kernels.paged_prefill_configs` (chosen so
the compiled kernel does not spill) unless given explicitly.

On CPU it runs under the Triton interpreter (``TRITON_INTERPRET=1``, set before
this backend is first constructed); there ``tl.dot`` on bfloat16 operands gives
wrong results, so bfloat16 operands are upcast to float32 before each product
when interpreting. On a GPU the products stay in bfloat16.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from graphcp.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec
from graphcp.attention.catalog import register_backend
from graphcp.attention.kernels.paged_prefill_configs import TileConfig, tile_config

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cpu_problem(device: torch.device | str) -> str | None:
    """Why Triton kernels cannot run on ``device`` in this process, or None: on a CPU
    only Triton's interpreter runs them, and Triton reads ``TRITON_INTERPRET`` when a
    kernel is defined (imported), so it must be set before that."""
    if torch.device(device).type != "cpu" or interpreting():
        return None
    return ("on a CPU Triton runs kernels only in its interpreter: set TRITON_INTERPRET=1 before triton is "
            "imported (the graphcp command does so itself)")


def _import_kernel() -> ModuleType:
    try:
        from graphcp.attention.kernels import paged_prefill as triton_kernel
    except ImportError as e:  # triton missing or broken
        raise ImportError(
            f"the 'triton' attention backend needs the triton package ({e}); "
            "install it with `pip install triton`"
        ) from e
    return triton_kernel


@torch.library.custom_op("graphcp::triton_paged_attention", mutates_args=("out", "lse"))
def triton_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, page_table: torch.Tensor,
    k_strides: list[int], v_strides: list[int], group: int, page_size: int, scale: float,
    block_m: int, block_n: int, upcast_dot: bool, num_warps: int, num_stages: int, causal: bool = True,
) -> None:
    _import_kernel().launch(
        q, k, v, out, lse, cu_seqlens_q, kv_lens, page_table,
        group=group, page_size=page_size, scale=scale, block_m=block_m, block_n=block_n,
        upcast_dot=upcast_dot, num_warps=num_warps, num_stages=num_stages,
        k_strides=tuple(k_strides), v_strides=tuple(v_strides), causal=causal,
    )


@register_backend("triton", kv_layout="NHD", per_request=False)
class TritonAttention(AttentionBackend):
    supports_full_graph = True

    @classmethod
    def device_problem(cls, device: torch.device | str) -> str | None:
        return cpu_problem(device)  # the module's, looked up per call

    def __init__(
        self,
        spec: AttentionSpec,
        block_m: int | None = None,
        block_n: int | None = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
    ) -> None:
        """``block_m`` counts lanes (query rows x the packed GQA group); each setting
        left None comes from :func:`tile_config` for the head_dim and q's dtype."""
        super().__init__(spec)
        d = spec.head_dim
        if d < 16 or d & (d - 1):
            raise ValueError(f"triton backend needs a power-of-two head_dim >= 16, got {d}")
        self._kernel = _import_kernel()
        self.group = spec.num_q_heads // spec.num_kv_heads
        lanes = self._kernel.group_lanes(self.group)
        for label, b in (("block_m", block_m), ("block_n", block_n)):
            if b is not None and (b < 16 or b & (b - 1)):
                raise ValueError(f"{label} must be a power of two >= 16 (tl.dot tiles), got {b}")
        if block_m is not None and block_m < lanes:
            raise ValueError(f"block_m={block_m} lanes cannot hold one row of a GQA group of {self.group} heads "
                             f"({lanes} lanes)")
        self._given = (block_m, block_n, num_warps, num_stages)
        self._configs: dict[torch.dtype, TileConfig] = {}

    def config(self, dtype: torch.dtype) -> TileConfig:
        """The tile settings a launch on ``dtype`` operands uses."""
        cfg = self._configs.get(dtype)
        if cfg is None:
            lanes = self._kernel.group_lanes(self.group)
            auto = tile_config(self.spec.head_dim, dtype, lanes)
            cfg = TileConfig(*(g if g is not None else a for g, a in zip(self._given, (
                auto.block_m, auto.block_n, auto.num_warps, auto.num_stages))))
            self._configs[dtype] = cfg
        return cfg

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        self._check(q, kv_cache, meta, out, lse)
        spec = self.spec
        k, v = kv_cache[:, 0], kv_cache[:, 1]  # [pages, *page] views
        if spec.kv_layout == "NHD":  # page = [tokens, heads, dim]
            k_strides = (k.stride(0), k.stride(1), k.stride(2), k.stride(3))
            v_strides = (v.stride(0), v.stride(1), v.stride(2), v.stride(3))
        else:  # HND: page = [heads, tokens, dim]
            k_strides = (k.stride(0), k.stride(2), k.stride(1), k.stride(3))
            v_strides = (v.stride(0), v.stride(2), v.stride(1), v.stride(3))
        # one registered op: a graph recorder (the CPU trace backend) logs and replays
        # the launch as a unit, as a CUDA graph holds it as one kernel node
        cfg = self.config(q.dtype)
        torch.ops.graphcp.triton_paged_attention(
            q, k, v, out, lse, meta.cu_seqlens_q, meta.kv_lens, meta.page_table,
            list(k_strides), list(v_strides),
            self.group, spec.page_size, spec.scale,
            cfg.block_m, cfg.block_n, interpreting() and q.dtype == torch.bfloat16,
            cfg.num_warps, cfg.num_stages, meta.causal,
        )

    def _check(self, q, kv_cache, meta, out, lse) -> None:
        spec = self.spec
        want_q = (spec.num_q_heads, spec.head_dim)
        if q.dim() != 3 or tuple(q.shape[1:]) != want_q:
            raise ValueError(f"q must be [rows, {want_q[0]}, {want_q[1]}], got {tuple(q.shape)}")
        if q.dtype not in _DTYPES:
            raise ValueError(f"q dtype {q.dtype} not supported; expected one of {_DTYPES}")
        if kv_cache.dtype != q.dtype:
            raise ValueError(f"kv_cache dtype {kv_cache.dtype} differs from q dtype {q.dtype}")
        page = (
            (spec.page_size, spec.num_kv_heads, spec.head_dim)
            if spec.kv_layout == "NHD"
            else (spec.num_kv_heads, spec.page_size, spec.head_dim)
        )
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or tuple(kv_cache.shape[2:]) != page:
            raise ValueError(
                f"kv_cache must be [pages, 2, {', '.join(map(str, page))}] ({spec.kv_layout}), "
                f"got {tuple(kv_cache.shape)}"
            )
        if out.shape != q.shape:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
        if lse is not None and (tuple(lse.shape) != tuple(q.shape[:2]) or lse.dtype != torch.float32):
            raise ValueError(
                f"lse must be float32 [{q.shape[0]}, {q.shape[1]}], got {lse.dtype} {tuple(lse.shape)}"
            )
        if meta.page_size != spec.page_size:
            raise ValueError(f"metadata page_size {meta.page_size} != spec page_size {spec.page_size}")
        for label, t in (("cu_seqlens_q", meta.cu_seqlens_q), ("kv_lens", meta.kv_lens),
                         ("page_table", meta.page_table)):
            if t.device != q.device:
                raise ValueError(f"metadata {label} is on {t.device}, q is on {q.device}")
