"""KV exchange v1: all-gather the K/V of every rank's padded local rows, then
write them into this rank's paged cache through the gathered slot mapping.

The gathered buffer has a fixed size (C x capacity rows, rank-major), so the
exchange is capturable; padding rows carry slot -1 and land in the scratch page.
After it every rank holds the batch's full KV (replicated across CP).

The slot mapping is CP-local on the host: each rank computes the slots of its own
rows only, and the body all-gathers them once per forward (:func:`gather_kv_slots`,
its first step), so host work per forward scales with T / C rather than T.
"""

from __future__ import annotations

import torch

from graphcp.kv.layout import write_kv
from graphcp.nvtx_ranges import nvtx_range


def gather_kv_slots(ctx) -> None:
    """Every rank's local slot mapping, rank-major, into ``ctx.gathered_kv_slots``:
    one small all-gather per forward (``C * capacity`` int64), shared by all layers."""
    with nvtx_range("kv_slots_gather", category="comm"):
        ctx.gathered_kv_slots = ctx.group.all_gather_rows(ctx.kv_slots)


def exchange_and_write_kv(ctx, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    slots = ctx.gathered_kv_slots
    if slots is None:
        raise RuntimeError("the KV exchange needs the gathered slot mapping: call gather_kv_slots(ctx) first")
    with nvtx_range(f"kv_exchange[{layer}]", category="comm"):
        kv = torch.cat([k, v], dim=1)  # [n, 2H, D]: one collective for both
        gathered = ctx.group.all_gather_rows(kv)
        # counted when this runs: eagerly, or once at capture (the runner adds a captured
        # segment's count to each replay)
        ctx.add_received(gathered.nbytes - kv.nbytes)
        kh = k.shape[1]
        write_kv(ctx.kv_cache.layer(layer), gathered[:, :kh], gathered[:, kh:], slots, ctx.kv_cache.layout)


def exchanged_bytes_per_layer(capacity: int, cp_size: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes each rank receives per layer in the all-gather (for the performance ledger)."""
    return exchanged_row_bytes_per_layer(capacity, cp_size, 2 * num_kv_heads * head_dim, elem_bytes)


def exchanged_row_bytes_per_layer(capacity: int, cp_size: int, values_per_token: int, elem_bytes: int) -> int:
    """The same for a cache of ``values_per_token`` a token (PagedKVCache.token_values)."""
    return (cp_size - 1) * capacity * values_per_token * elem_bytes
