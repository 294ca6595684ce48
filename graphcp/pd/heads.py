"""The KV export under attention TP: each rank's cache holds its own KV heads, so a
request's export is assembled per head shard over the CP group, then the shards are
gathered over attention TP in head order (a KV head replicated over several ranks,
when the model has fewer KV heads than the attention-TP ranks, kept once): to every
rank of the attention-TP group (an all-gather) or to one (point to point: only the
ranks that hold distinct heads send, one message each)."""

from __future__ import annotations

from dataclasses import replace

import torch

from graphcp.dist import CPGroup
from graphcp.pd.export import KVMeta


def shard_meta(meta: KVMeta, local_kv_heads: int) -> KVMeta:
    """``meta`` with one rank's KV heads (what its cache's spans assemble to)."""
    return replace(meta, num_kv_heads=local_kv_heads)


def head_owners(attn_tp_size: int, num_kv_heads: int) -> list[int]:
    """The attention-TP ranks whose shards hold distinct KV heads, in head order (every
    rank, or with fewer KV heads than ranks, the first of each head's A / H copies)."""
    step = attn_tp_size // num_kv_heads if num_kv_heads < attn_tp_size else 1
    return list(range(0, attn_tp_size, step))


def gather_heads(out: list[dict[str, torch.Tensor]] | None, attn_tp: CPGroup, num_kv_heads: int,
                 dst: int | None = None) -> list[dict[str, torch.Tensor]] | None:
    """Each layer's tensors ``[local heads, tokens, head_dim]`` -> the model's
    ``[num_kv_heads, tokens, head_dim]``: on every rank of ``attn_tp`` (``dst`` None, in
    place), or on its rank ``dst`` only (the others return None). Every rank calls it."""
    if dst is None:
        for layer in out:
            for name, t in layer.items():
                every = attn_tp.all_gather_rows(t)  # [A * local, tokens, head_dim], attention-TP rank-major
                if every.shape[0] != num_kv_heads:  # fewer KV heads than ranks: A / H copies of each
                    every = every[:: attn_tp.size // num_kv_heads]
                layer[name] = every.contiguous()
        return out
    owners = head_owners(attn_tp.size, num_kv_heads)
    me = attn_tp.rank
    flat = [t for layer in out for t in layer.values()]
    if me != dst:
        if me in owners:  # one message: all this rank's heads of every layer
            attn_tp.send(torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in flat]), dst)
        return None
    shards = {me: flat}
    for owner in owners:
        if owner != me:
            buf = attn_tp.recv_(torch.empty(sum(t.numel() * t.element_size() for t in flat), dtype=torch.uint8,
                                            device=flat[0].device), owner)
            shards[owner] = _split(buf, flat)
    heads = iter(torch.cat([shards[o][i] for o in owners]) for i in range(len(flat)))
    return [{name: next(heads) for name in layer} for layer in out]


def _split(buf: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``buf``'s bytes as tensors shaped and typed as ``like``, in order."""
    parts, at = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        raw = buf[at:at + n] if at % t.element_size() == 0 else buf[at:at + n].clone()  # (aligned to its dtype)
        parts.append(raw.view(t.dtype).view(t.shape))
        at += n
    return parts
