"""What the all-gather exchange (graphcp.attention.kv_exchange.AllGather) moves: every
rank's padded local K/V rows gathered to every rank, a fixed ``C x capacity`` rows a
layer (so the exchange is capturable; padding rows carry slot -1 and land in the scratch
page). The formulas the performance ledger and the tests hold the measured bytes to."""

from __future__ import annotations


def exchanged_bytes_per_layer(capacity: int, cp_size: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes each rank receives per layer in the all-gather (for the performance ledger)."""
    return exchanged_row_bytes_per_layer(capacity, cp_size, 2 * num_kv_heads * head_dim, elem_bytes)


def exchanged_row_bytes_per_layer(capacity: int, cp_size: int, values_per_token: int, elem_bytes: int) -> int:
    """The same for a cache of ``values_per_token`` a token (PagedKVCache.token_values)."""
    return (cp_size - 1) * capacity * values_per_token * elem_bytes
