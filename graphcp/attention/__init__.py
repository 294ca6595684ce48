"""Attention contract, backends and the KV exchange."""

from graphcp.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec
from graphcp.attention.registry import available_backends, make_attention, preferred_kv_layout

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "available_backends",
    "make_attention",
    "preferred_kv_layout",
]
