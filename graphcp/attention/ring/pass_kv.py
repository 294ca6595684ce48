"""Ring pass-KV: the KV circulates, the queries stay.

Rank ``r`` first sends its message (its pool pages of the batch's requests, cached
pieces and this forward's blocks, gathered in batch order) to rank ``r + 1`` and
posts the receive of rank ``r - 1``'s, then attends its rows to its own keys (step
0, causal). At step ``i`` it holds rank ``(r - i) mod C``'s message: it posts
forwarding it to ``r + 1`` (and receiving the next one into the other buffer)
before attending its rows to it (non-causal: the zigzag blocks never interleave),
so the transfer overlaps the attention. Partial results are merged by LSE into
float32 accumulators after each step (:func:`graphcp.attention.ring.merge.merge_states`).
Two staging buffers of the largest message (plus the scratch page 0) serve every
step; a message travels as pages, so each step is plain paged attention that every
backend runs unchanged.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from graphcp.attention.base import AttentionBackend
from graphcp.attention.ring.buffers import RingBuffers
from graphcp.attention.ring.merge import merge_states
from graphcp.attention.ring.plan import RingPlan
from graphcp.attention.ring.schedule import run_ring_schedule


def buffers(rows: int, max_pages: int, heads: int, dim: int, q_dtype: torch.dtype, page_shape: tuple[int, ...],
            kv_dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every buffer pass-KV uses, name -> (shape, dtype), for ``rows`` query rows of this
    rank and messages of up to ``max_pages`` pages: the two staging buffers (page 0 of
    each is scratch: empty segments' page-table entries point there), the step's partial
    output and LSE, the merge's float32 accumulators. The run and the per-bucket
    reservation (:meth:`RingAttention.reserve`) both size them here."""
    f32 = torch.float32
    return {"kv_stage0": ((1 + max_pages, *page_shape), kv_dtype),
            "kv_stage1": ((1 + max_pages, *page_shape), kv_dtype),
            "part_out": ((rows, heads, dim), q_dtype), "part_lse": ((rows, heads), f32),
            "acc_out": ((rows, heads, dim), f32), "acc_lse": ((rows, heads), f32)}


def run_pass_kv(ring: RingPlan, group, backends: Sequence[AttentionBackend], kv_layer: torch.Tensor,
                bufs: RingBuffers, q: torch.Tensor, out: torch.Tensor) -> int:
    """Attend this rank's rows ``q[:n]`` over every rank's keys; write ``out[:n]``.
    ``backends[i]`` is prepared with ``ring.steps[i]``. Returns the bytes received."""
    n, (_, heads, dim) = ring.rows[ring.rank], q.shape
    page_shape = tuple(kv_layer.shape[1:])
    pages = ring.msg_pages
    b = {name: bufs.get(name, *spec)
         for name, spec in buffers(n, max(pages), heads, dim, q.dtype, page_shape, kv_layer.dtype).items()}
    stage = [b["kv_stage0"], b["kv_stage1"]]
    mine = pages[ring.rank]
    if mine:
        torch.index_select(kv_layer, 0, ring.send_index(kv_layer.device), out=stage[0][1 : 1 + mine])
    part, part_lse, acc, acc_lse = b["part_out"], b["part_lse"], b["acc_out"], b["acc_lse"]

    def step(i: int, src: int) -> None:
        keys = kv_layer if i == 0 else stage[i % 2][: 1 + pages[src]]
        backends[i].forward(q[:n], keys, ring.steps[i], part, part_lse)
        if i == 0:
            acc.copy_(part)
            acc_lse.copy_(part_lse)
        else:
            merge_states([acc, part], [acc_lse, part_lse], acc, acc_lse)

    page_bytes = math.prod(page_shape) * kv_layer.element_size()
    received = run_ring_schedule(group, pages, page_bytes, stage[0][1:], [s[1:] for s in stage], step)
    out[:n].copy_(acc)
    return received
