"""Attention contract, backends and the KV exchange."""

from graphcp.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec"]
