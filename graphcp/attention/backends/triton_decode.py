"""``triton``'s decode kernel (:mod:`graphcp.attention.kernels.paged_decode`): what a
decode graph captures when the engine's attention backend is ``triton``.

One program a (request, KV head, split of its keys) reads the request's own pages up to
its length, on the device, and the splits merge by their LSE in a second launch; the
grid is fixed by the bucket's static shapes (``q``'s rows, the page table's width), so
a captured launch replays for every step of its bucket. On a CPU it runs in Triton's
interpreter (``TRITON_INTERPRET=1``), bfloat16 operands upcast to float32 before each
product there (the interpreter's bfloat16 ``tl.dot`` is wrong), as the prefill kernel's.
"""

from __future__ import annotations

from types import ModuleType

import torch

from graphcp.attention.backends.triton import cpu_problem, interpreting
from graphcp.attention.base import AttentionMetadata, AttentionSpec, DecodeKernel
from graphcp.attention.catalog import register_decode_backend
from graphcp.attention.kernels.paged_decode_configs import decode_tile


def _import_kernel() -> ModuleType:
    try:
        from graphcp.attention.kernels import paged_decode
    except ImportError as e:  # triton missing or broken
        raise ImportError(f"the 'triton' decode kernel needs the triton package ({e}); install it with "
                          "`pip install triton`") from e
    return paged_decode


@torch.library.custom_op("graphcp::triton_paged_decode", mutates_args=("out", "lse"))
def triton_paged_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
    kv_lens: torch.Tensor, page_table: torch.Tensor, k_strides: list[int], v_strides: list[int], group: int,
    page_size: int, scale: float, block_n: int, upcast_dot: bool, num_warps: int, num_stages: int, splits: int,
) -> None:
    """One decode launch (and its merge): a unit a graph recorder logs and replays, as a
    CUDA graph holds the kernels. ``splits``: 0 for the kernel's own choice."""
    _import_kernel().launch(q, k, v, out, lse, kv_lens, page_table, group=group, page_size=page_size, scale=scale,
                            block_n=block_n, upcast_dot=upcast_dot, num_warps=num_warps, num_stages=num_stages,
                            k_strides=tuple(k_strides), v_strides=tuple(v_strides), splits=splits or None)


@register_decode_backend("triton")
class TritonDecodeAttention(DecodeKernel):
    """See the module doc; ``splits``: a fixed number of key splits (None: by the shapes)."""

    name = "triton-decode"

    @classmethod
    def device_problem(cls, device: torch.device | str) -> str | None:
        return cpu_problem(device)

    def __init__(self, spec: AttentionSpec, splits: int | None = None) -> None:
        super().__init__(spec)
        d = spec.head_dim
        if d < 16 or d & (d - 1):
            raise ValueError(f"the triton decode kernel needs a power-of-two head_dim >= 16, got {d}")
        _import_kernel()
        self.group = spec.num_q_heads // spec.num_kv_heads
        self.splits = splits

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor,
                lse: torch.Tensor | None = None) -> None:
        spec, rows = self.spec, meta.kv_lens.shape[0]
        k, v = kv_cache[:, 0], kv_cache[:, 1]
        if spec.kv_layout == "NHD":  # page = [tokens, heads, dim]
            k_strides, v_strides = (k.stride(0), k.stride(1), k.stride(2), k.stride(3)), \
                (v.stride(0), v.stride(1), v.stride(2), v.stride(3))
        else:  # HND: page = [heads, tokens, dim]
            k_strides, v_strides = (k.stride(0), k.stride(2), k.stride(1), k.stride(3)), \
                (v.stride(0), v.stride(2), v.stride(1), v.stride(3))
        tile = decode_tile(spec.head_dim, q.dtype)
        torch.ops.graphcp.triton_paged_decode(
            q[:rows], k, v, out[:rows], None if lse is None else lse[:rows], meta.kv_lens, meta.page_table,
            list(k_strides), list(v_strides), self.group, spec.page_size, spec.scale, tile.block_n,
            interpreting() and q.dtype == torch.bfloat16, tile.num_warps, tile.num_stages, self.splits or 0)
