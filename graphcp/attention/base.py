"""The attention contract every backend implements.

A backend attends a rank's query rows over the paged KV cache, one *segment* at a
time. A segment is a contiguous run of query rows (local order) that attends one
request's KV with bottom-right causal alignment: row ``i`` of a segment of
``q_len`` rows sees cache positions ``< kv_len - q_len + i + 1``.

Metadata is explicit per forward (:class:`AttentionMetadata`), never global.
Rows of ``q`` past ``cu_seqlens_q[-1]`` are padding: a backend must not write
their output or LSE rows.

LSE is the natural-log (base e) log-sum-exp of the scaled scores of each query
row and head. Backends whose kernels return base-2 LSE convert before writing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

KVLayout = Literal["NHD", "HND"]
LSE_BASE = "e"


@dataclass(frozen=True)
class AttentionMetadata:
    """Segments of one rank's query rows for one forward.

    Device tensors (int32, on the model's device) are what kernels read; the host
    arrays are what host-side planners and the torch reference loop over.
    ``page_table[s, p]`` is the cache page holding positions
    ``[p * page_size, (p + 1) * page_size)`` of segment ``s``'s request; entries
    past the request's pages are 0 (the scratch page) and never read.
    """

    cu_seqlens_q: torch.Tensor  # int32 [S + 1]
    kv_lens: torch.Tensor  # int32 [S]
    page_table: torch.Tensor  # int32 [S, max_pages]
    cu_seqlens_q_host: np.ndarray  # int32 [S + 1]
    kv_lens_host: np.ndarray  # int32 [S]
    page_table_host: np.ndarray  # int32 [S, max_pages]
    page_size: int
    max_q_len: int
    max_kv_len: int

    @property
    def num_segments(self) -> int:
        return int(self.kv_lens_host.shape[0])

    @property
    def num_q_rows(self) -> int:
        """Rows that belong to a segment; rows of ``q`` past this are padding."""
        return int(self.cu_seqlens_q_host[-1])

    @property
    def q_lens_host(self) -> np.ndarray:
        return np.diff(self.cu_seqlens_q_host)

    @classmethod
    def from_host(
        cls,
        cu_seqlens_q: np.ndarray,
        kv_lens: np.ndarray,
        page_table: np.ndarray,
        page_size: int,
        device: torch.device | str = "cpu",
        validate: bool = True,
    ) -> "AttentionMetadata":
        """``validate=False`` skips the consistency checks, for metadata a layout
        built (the engine's per-forward path; the layouts are property-tested)."""
        # own, writable copies: torch.from_numpy shares memory with them
        cu = np.array(cu_seqlens_q, dtype=np.int32)
        kv = np.array(kv_lens, dtype=np.int32)
        pt = np.array(page_table, dtype=np.int32)
        q_lens = cu[1:] - cu[:-1]
        if validate:
            cls._validate(cu, kv, pt, q_lens, page_size)
        on_cpu = device == "cpu" or getattr(device, "type", None) == "cpu"
        cu_t, kv_t, pt_t = torch.from_numpy(cu), torch.from_numpy(kv), torch.from_numpy(pt)
        return cls(
            cu_seqlens_q=cu_t if on_cpu else cu_t.to(device),
            kv_lens=kv_t if on_cpu else kv_t.to(device),
            page_table=pt_t if on_cpu else pt_t.to(device),
            cu_seqlens_q_host=cu,
            kv_lens_host=kv,
            page_table_host=pt,
            page_size=page_size,
            max_q_len=int(q_lens.max()) if q_lens.size else 0,
            max_kv_len=int(kv.max()) if kv.size else 0,
        )

    @staticmethod
    def _validate(cu: np.ndarray, kv: np.ndarray, pt: np.ndarray, q_lens: np.ndarray, page_size: int) -> None:
        if cu.ndim != 1 or kv.ndim != 1 or cu.shape[0] != kv.shape[0] + 1:
            raise ValueError(
                f"cu_seqlens_q must have one more entry than kv_lens; got {cu.shape} and {kv.shape}"
            )
        if pt.ndim != 2 or pt.shape[0] != kv.shape[0]:
            raise ValueError(f"page_table must be [num_segments={kv.shape[0]}, pages]; got {pt.shape}")
        if (q_lens < 0).any() or (q_lens > kv).any():
            raise ValueError("every segment needs 0 <= q_len <= kv_len")
        if kv.size and int(kv.max()) > pt.shape[1] * page_size:
            raise ValueError(
                f"kv_len {int(kv.max())} exceeds the page table's {pt.shape[1]} pages of {page_size}"
            )


@dataclass(frozen=True)
class AttentionSpec:
    """Static shape facts a backend is built for."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    scale: float
    kv_layout: KVLayout = "NHD"

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {self.kv_layout!r}")


class AttentionBackend(ABC):
    """Phases: ``prepare`` (host side, once per forward, before any replay) and
    ``forward`` (per layer; may run inside a captured graph when
    ``supports_full_graph``)."""

    name: str = "base"
    #: the backend can run inside a captured graph, reading only static device metadata
    supports_full_graph: bool = False

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional phase
        """Host-side planning for this forward's metadata (no-op by default)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Attend ``q`` [rows, Hq, D] over ``kv_cache`` (one layer, see
        :mod:`graphcp.kvcache`); write ``out`` [rows, Hq, D] and, when given,
        ``lse`` [rows, Hq] float32 (base e) for the rows of every segment."""


def kv_cache_views(kv_cache: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's cache as [pages, page_size, H, D] views (NHD order)."""
    k, v = kv_cache[:, 0], kv_cache[:, 1]
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v
