"""Fixtures of the attention backend tests: the worked example, the spec the
FlashInfer/trtllm tests use, full-graph capture metadata, and the assertion over
the shared harness (:mod:`graphcp.attention.reference_cases`: plans, paged inputs,
the torch reference, tolerances, the comparison)."""

from __future__ import annotations

import numpy as np
import torch

from graphcp.attention.base import AttentionMetadata, AttentionSpec
from graphcp.attention.reference_cases import against_reference, paged_metadata, zigzag_plan

# The worked example: C = 2, rank 0, extend [40, 3], prefix [20, 0], page size 16.
# Request 0: blocks [10, 10, 10, 10] -> early q 10 kv 30, late q 10 kv 60 (pages 1-4).
# Request 1: blocks [1, 1, 1, 0]    -> early q 1 kv 1, late q 0 kv 3 (empty; page 5).
EXAMPLE = dict(extend=[40, 3], prefix=[20, 0], cp=2, rank=0, page_size=16)


def zigzag_meta(
    extend: list[int], prefix: list[int], cp: int, rank: int, page_size: int, width: int = 8
) -> AttentionMetadata:
    """Segments (early, late) per request; request j owns pages allocated in order from 1."""
    return paged_metadata(zigzag_plan(extend, prefix, cp, rank), page_size, width=width)[0]


def static_meta(num_segments: int, width: int, page_size: int, capacity: int,
                cu: torch.Tensor, kv: torch.Tensor, table: torch.Tensor) -> AttentionMetadata:
    """Full-graph capture metadata as the graph runner builds it: zero host arrays
    (bounds only, ``max_q_len`` = the bucket's rows) over static device buffers."""
    return AttentionMetadata(
        np.zeros(num_segments + 1, np.int32), np.zeros(num_segments, np.int32),
        np.zeros((num_segments, width), np.int32), page_size, capacity, width * page_size,
        device_tensors=(cu, kv, table),
    )


def spec_for(page_size: int, layout: str = "NHD") -> AttentionSpec:
    return AttentionSpec(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=page_size, scale=0.125, kv_layout=layout)


def num_pages_for(*metas: AttentionMetadata) -> int:
    return max(int(m.page_table_host.max()) for m in metas) + 1


def check_against_reference(spec, q, kv, meta, out, lse) -> None:
    """Live rows equal the float32 reference within ``q``'s dtype tolerance; padding
    rows of ``out`` (and ``lse``) kept the sentinel."""
    cmp = against_reference(spec, q, kv, meta, out, lse)
    assert cmp.ok, cmp
