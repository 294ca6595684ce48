"""How one layer of a paged KV cache is laid out, read and written: the page layout
(:data:`KVLayout`), K/V views in one order whatever the layout, and the scatter of
rows into cache slots (slot -1, padding, lands in the scratch page)."""

from __future__ import annotations

from typing import Literal

import torch

#: a page's order: ``NHD`` ``[page_size, num_kv_heads, head_dim]`` (FlashInfer's
#: default) or ``HND`` ``[num_kv_heads, page_size, head_dim]`` (what trtllm-gen reads)
KVLayout = Literal["NHD", "HND"]


def kv_cache_views(kv_cache: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's cache as [pages, page_size, H, D] views (NHD order)."""
    k, v = kv_cache[:, 0], kv_cache[:, 1]
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, layout: KVLayout
) -> None:
    """Scatter rows of ``k``/``v`` [n, H, D] into one layer's cache at ``slots`` [n];
    slot -1 (padding) goes to the scratch page so the write keeps a static shape."""
    page_size = kv_cache.shape[2] if layout == "NHD" else kv_cache.shape[3]
    s = slots.clamp(min=0)
    page, off = torch.div(s, page_size, rounding_mode="floor"), s % page_size
    if layout == "NHD":
        kv_cache[page, 0, off] = k
        kv_cache[page, 1, off] = v
    else:
        kv_cache[page, 0, :, off] = k
        kv_cache[page, 1, :, off] = v
