"""The storage of a dense model's tokens: K and V of the KV heads (:class:`KVHeads`).

``pool`` is one tensor ``[layers, num_pages, 2, *page]`` where index 0/1 of the third
dimension is K/V and ``page`` is

- ``NHD``: ``[page_size, num_kv_heads, head_dim]`` (FlashInfer's default), or
- ``HND``: ``[num_kv_heads, page_size, head_dim]`` (what trtllm-gen reads).

``layer(i)`` is the ``[num_pages, 2, *page]`` tensor the attention backends take. The
pool holds the layers this rank keeps (:class:`~graphcp.kv.layers.LayerSlots`: every
served one, or under the layer split its own and one scratch layer); a family whose
other layers keep states keeps one of these over its attention layers only.
"""

from __future__ import annotations

from typing import Sequence

import torch

from graphcp.kv.layers import HeldLayers, LayerSlots
from graphcp.kv.layout import kv_cache_views, write_kv
from graphcp.kv.spec import KVHeads, PoolSpec
from graphcp.kv.storage.base import Storage, itemsize


class KVHeadsStorage(Storage):
    """K/V of ``geometry``'s heads for ``layers`` (default: every served one) of the
    ``held`` layers; ``what``: how a served layer outside ``layers`` is refused."""

    def __init__(self, geometry: KVHeads, pool: PoolSpec, held: HeldLayers, layers: Sequence[int] | None = None,
                 what: str = "has no K/V here") -> None:
        if geometry.layout not in ("NHD", "HND"):
            raise ValueError(f"layout must be 'NHD' or 'HND', got {geometry.layout!r}")
        self.num_kv_heads, self.head_dim, self.layout = geometry.num_kv_heads, geometry.head_dim, geometry.layout
        self.num_pages, self.page_size, self.held = pool.num_pages, pool.page_size, held
        self.slots = LayerSlots(held, layers, what=what)
        n, h, d = pool.page_size, self.num_kv_heads, self.head_dim
        page = (n, h, d) if self.layout == "NHD" else (h, n, d)
        self.pool = torch.zeros((self.slots.depth, pool.num_pages, 2, *page), dtype=pool.dtype, device=pool.device)
        self._index = self.slots.index
        self._layer_views: tuple = (None, ())  # (the pool they view, its layers)

    @classmethod
    def create(cls, geometry: KVHeads, pool: PoolSpec, held: HeldLayers) -> "KVHeadsStorage":
        return cls(geometry, pool, held)

    @classmethod
    def pool_bytes(cls, geometry: KVHeads, pool: PoolSpec, held: HeldLayers,
                   layers: Sequence[int] | None = None) -> int:
        depth = LayerSlots(held, layers).depth
        return (depth * pool.num_pages * 2 * pool.page_size * geometry.num_kv_heads * geometry.head_dim
                * itemsize(pool.dtype))

    def layer(self, i: int) -> torch.Tensor:
        """The cache of global decoder layer ``i`` (one view per pool layer, made once per
        pool: every attention break asks, and slicing the pool costs ~1 us a time)."""
        j = self._index.get(i)
        if j is None:
            self.slots.refuse(i)
        pool, views = self._layer_views
        if pool is not self.pool:  # first use, or the pool was replaced
            with torch.inference_mode(False):  # plain views, whichever mode the first call ran in
                pool, views = self._layer_views = (self.pool, self.pool.unbind(0))
        return views[j]

    def layer_pools(self, layer: int) -> list[torch.Tensor]:
        return [self.layer(layer)]

    def write(self, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """``rows [n, 2 * num_kv_heads, head_dim]``: K's heads, then V's."""
        h = self.num_kv_heads
        write_kv(self.layer(layer), rows[:, :h], rows[:, h:], slots, self.layout)

    def token_values(self, layer: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def page_pools(self) -> dict[str, torch.Tensor]:
        return {"kv_cache": self.pool}

    def read_span(self, pages: tuple[int, ...], layer: int, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """K and V, each ``[num_kv_heads, stop - start, head_dim]`` (new contiguous tensors)."""
        ps = self.page_size
        first, last = start // ps, -(-stop // ps)
        index = torch.tensor(pages[first:last], dtype=torch.long, device=self.pool.device)
        k_pages, v_pages = kv_cache_views(self.layer(layer), self.layout)  # [pages, ps, H, D]
        lo, hi = start - first * ps, stop - first * ps
        k = k_pages.index_select(0, index).flatten(0, 1)[lo:hi]
        v = v_pages.index_select(0, index).flatten(0, 1)[lo:hi]
        return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()

    def write_span(self, layer: int, values: tuple[torch.Tensor, ...], slots: torch.Tensor) -> None:
        """K and V ``[num_kv_heads, n, head_dim]`` each (what :meth:`read_span` returns) at ``slots``."""
        k, v = values
        self.write(layer, torch.cat([k.transpose(0, 1), v.transpose(0, 1)], dim=1), slots)
