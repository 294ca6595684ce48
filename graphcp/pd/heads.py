"""The KV export under attention TP: each rank's cache holds its own heads, so a
request's export is assembled per head shard over the CP group, then the shards are
gathered over attention TP and merged in head order as the format says (``head_shard`` /
``merge_heads`` of its metadata: graphcp-kv/1 keeps a KV head replicated over several
ranks once; a family's format may regroup more, such as a convolution's channels): to every
rank of the attention-TP group (an all-gather) or to one (point to point: each other
rank sends its shards of every layer in one message)."""

from __future__ import annotations

import torch

from graphcp.dist import CPGroup


def shard_meta(meta, attn_tp_size: int):
    """``meta`` with one attention-TP rank's heads (what its cache's spans assemble to)."""
    return meta.head_shard(attn_tp_size)


def head_owners(attn_tp_size: int, num_kv_heads: int) -> list[int]:
    """The attention-TP ranks whose shards hold distinct KV heads, in head order (every
    rank, or with fewer KV heads than ranks, the first of each head's A / H copies)."""
    step = attn_tp_size // num_kv_heads if num_kv_heads < attn_tp_size else 1
    return list(range(0, attn_tp_size, step))


def gather_heads(out: list[dict[str, torch.Tensor]], attn_tp: CPGroup, meta,
                 dst: int | None = None) -> list[dict[str, torch.Tensor]] | None:
    """Each layer's tensors of this rank's heads -> the model's: on every rank of
    ``attn_tp`` (``dst`` None, in place), or on its rank ``dst`` only (the others return
    None). Every rank calls it."""
    if dst is None:
        for i, layer in enumerate(out):
            for name, t in layer.items():
                layer[name] = meta.merge_heads(i, name, attn_tp.all_gather_rows(t), attn_tp.size)
        return out
    me = attn_tp.rank
    flat = [t for layer in out for t in layer.values()]
    if me != dst:  # one message: all this rank's heads of every layer
        attn_tp.send(torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in flat]), dst)
        return None
    shards = {me: flat}
    nbytes = sum(t.numel() * t.element_size() for t in flat)
    for rank in range(attn_tp.size):
        if rank != me:
            buf = attn_tp.recv_(torch.empty(nbytes, dtype=torch.uint8, device=flat[0].device), rank)
            shards[rank] = _split(buf, flat)
    every = iter(torch.cat([shards[r][k] for r in range(attn_tp.size)]) for k in range(len(flat)))
    return [{name: meta.merge_heads(i, name, next(every), attn_tp.size) for name in layer}
            for i, layer in enumerate(out)]


def _split(buf: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``buf``'s bytes as tensors shaped and typed as ``like``, in order."""
    parts, at = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        raw = buf[at:at + n] if at % t.element_size() == 0 else buf[at:at + n].clone()  # (aligned to its dtype)
        parts.append(raw.view(t.dtype).view(t.shape))
        at += n
    return parts
