"""Attention contract, backends and the KV exchange."""

from graphcp.attention.base import Attention, AttentionBackend, AttentionMetadata, AttentionSpec
from graphcp.attention.catalog import AttentionLimits, register_backend
from graphcp.attention.registry import available_backends, make_attention, preferred_kv_layout

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionLimits",
    "AttentionMetadata",
    "AttentionSpec",
    "available_backends",
    "make_attention",
    "preferred_kv_layout",
    "register_backend",
]
