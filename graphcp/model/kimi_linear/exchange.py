"""How a KDA hybrid's forward stores and attends: its MLA layers' rows through the cache
mode's all-gather (as a DSA model's), its KDA layers through the hybrid family's scan
across the CP ranks (graphcp.model.hybrid.exchange, whose planner and per-forward scan
this reuses) with KDA's local kernels (graphcp.model.kimi_linear.kernels); a decode
step's KDA layers take the hybrid's step with KDA's step kernels. Registered
as ``kda+<the mode's exchange>``, the name :class:`~graphcp.model.kimi_linear.cache.KdaStorage`
gives."""

from __future__ import annotations

import torch

from graphcp.attention.kv_exchange import KVForward, register_exchange
from graphcp.model.hybrid.exchange import HybridDecode, HybridExchange
from graphcp.model.kimi_linear import kernels


class KdaExchange(HybridExchange):
    """The hybrid's exchange with KDA's kernels, and MLA's row store passed to the inner
    exchange."""

    def __init__(self, inner, device: torch.device) -> None:
        super().__init__(inner, device)
        self.kernels = kernels.select_kernels(device)
        #: a decode step's KDA kernels (the hybrid's step with KDA's rule and convolution)
        self.decode = HybridDecode(inner.decode, kernels.step_kernels(self.kernels))

    def reserve(self, capacity: int, cache, layer: int, heads: int, dim: int, dtype: torch.dtype) -> None:
        self.inner.reserve(capacity, cache, layer, heads, dim, dtype)

    def store_rows(self, fwd: KVForward, layer: int, rows: torch.Tensor) -> int:
        return self.inner.store_rows(self._inner(fwd), layer, rows)


@register_exchange
class KdaAllGather(KdaExchange):
    name = "kda+all-gather"
    inner_name = "all-gather"
