"""The KV export under attention TP: each rank's cache holds its own KV heads, so a
request's export is assembled per head shard over the CP group (every rank of the
shard receiving), then the shards are all-gathered over attention TP in head order
(a KV head replicated over several ranks, when the model has fewer KV heads than the
attention-TP ranks, kept once)."""

from __future__ import annotations

from dataclasses import replace

import torch

from graphcp.dist import CPGroup
from graphcp.pd.export import KVMeta


def shard_meta(meta: KVMeta, local_kv_heads: int) -> KVMeta:
    """``meta`` with one rank's KV heads (what its cache's spans assemble to)."""
    return replace(meta, num_kv_heads=local_kv_heads)


def gather_heads(out: list[dict[str, torch.Tensor]], attn_tp: CPGroup, num_kv_heads: int) -> None:
    """Each layer's tensors ``[local heads, tokens, head_dim]`` -> the model's
    ``[num_kv_heads, tokens, head_dim]`` on every rank of ``attn_tp`` (in place)."""
    A = attn_tp.size
    for layer in out:
        for name, t in layer.items():
            every = attn_tp.all_gather_rows(t)  # [A * local, tokens, head_dim], attention-TP rank-major
            if every.shape[0] != num_kv_heads:  # fewer KV heads than ranks: A / H copies of each
                every = every[:: A // num_kv_heads]
            layer[name] = every.contiguous()
