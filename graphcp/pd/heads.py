"""The KV export under attention TP: each rank's cache holds its own heads, so a
request's export is assembled per head shard over the CP group (every rank of the shard
receiving), then the shards are all-gathered over attention TP and merged in head order
as the format says (``head_shard`` / ``merge_heads`` of its metadata: graphcp-kv/1 keeps
a KV head replicated over several ranks once; graphcp-hybrid/1 also regroups its
linear layers' conv channels)."""

from __future__ import annotations

import torch

from graphcp.dist import CPGroup


def shard_meta(meta, attn_tp_size: int):
    """``meta`` with one attention-TP rank's heads (what its cache's spans assemble to)."""
    return meta.head_shard(attn_tp_size)


def gather_heads(out: list[dict[str, torch.Tensor]], attn_tp: CPGroup, meta) -> None:
    """Each layer's tensors of this rank's heads -> the model's, on every rank of
    ``attn_tp`` (in place)."""
    for i, layer in enumerate(out):
        for name, t in layer.items():
            layer[name] = meta.merge_heads(i, name, attn_tp.all_gather_rows(t), attn_tp.size)
