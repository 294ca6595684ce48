"""A KDA hybrid's cache storage: the MLA layers' latent rows (graphcp.model.dsa.cache's
``MlaStorage``, over those layers only) beside each live request's KDA states
(graphcp.model.hybrid.cache's ``LinearStates``: the recurrent state ``[H, d_k, d_v]``
float32 and the last ``K`` pre-convolution rows ``[K, 3 H d]``, two slots a request).

Per token and MLA layer: the latent and the shared (unrotated) rope-slice key
(``kv_lora_rank + qk_rope_head_dim`` values) and, in a layer that runs GLM-5-Next's
pooled indexer, the indexer's key and its pooling gate (``2 index_head_dim``: the pools
are formed from them in the attention break). Cache modes: the replicated cache and the
layer split (MLA's latent is one head a token: the token-sharded ring is refused,
docs/hybrid.md); the states as the hybrid keeps them in both (under the layer split,
the layer's owner broadcasts the batch's prefix states before the layer runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcp.kv.layers import HeldLayers, LayerSlots
from graphcp.kv.spec import CacheGeometry, PoolSpec
from graphcp.kv.storage.base import itemsize
from graphcp.model.dsa.cache import MlaGeometry, MlaStorage
from graphcp.model.hybrid.cache import LinearDims, LinearStates
from graphcp.model.hybrid.export import FULL, LINEAR

_NO_LATENT = "is a KDA layer: it caches states, not latent rows"


@dataclass(frozen=True)
class LatentGeometry(MlaGeometry):
    """MLA's rows of the layers in ``latent_layers`` only (a KDA layer has none)."""

    latent_layers: tuple[int, ...] = ()

    def slots(self, pool: PoolSpec, held: HeldLayers) -> tuple[LayerSlots, LayerSlots]:
        indexer = self.indexer_of(pool.layers)
        if len(indexer) != len(pool.layers):
            raise ValueError(f"indexer_layers has {len(indexer)} entries for {len(pool.layers)} layers")
        latent = [i for i in pool.layers if i in self.latent_layers]
        index = [i for i, full in zip(pool.layers, indexer) if full]
        return (LayerSlots(held, latent, what=_NO_LATENT),
                LayerSlots(held, index, what="keeps no indexer keys (a KDA or a 'shared' layer)"))


@dataclass(frozen=True)
class KdaGeometry(CacheGeometry):
    """What a KDA hybrid's cache sizes by: the MLA layers' rows, every layer's kind, the
    KDA layers' heads (``LinearDims``: as many key as value heads) and the live requests
    whose states it keeps (what ``LinearStates`` reads)."""

    latent: LatentGeometry
    layer_kinds: tuple[str, ...]
    linear: LinearDims
    state_slots: int
    #: per-row verify states (LinearStates reads it): none, as a KDA hybrid takes no draft
    verify_rows: int = 0

    def of_kind(self, layers, kind: str) -> list[int]:
        return [i for i in layers if self.layer_kinds[i] == kind]


class KdaStorage(MlaStorage):
    """``MlaStorage`` over the MLA layers and ``LinearStates`` over the KDA layers."""

    def __init__(self, geometry: KdaGeometry, pool: PoolSpec, held: HeldLayers) -> None:
        super().__init__(geometry.latent, pool, held)
        self.geometry = geometry
        self.full_layers = tuple(geometry.of_kind(held.served, FULL))
        self.states = LinearStates(geometry, pool, held)  # type: ignore[arg-type] (its geometry's fields)
        self.state_layers = frozenset(geometry.of_kind(held.served, LINEAR))
        self.index_split = geometry.latent.index_dim // 2

    @classmethod
    def create(cls, geometry: KdaGeometry, pool: PoolSpec, held: HeldLayers) -> "KdaStorage":
        return cls(geometry, pool, held)

    @classmethod
    def pool_bytes(cls, geometry: KdaGeometry, pool: PoolSpec, held: HeldLayers) -> int:
        linear = [i for i in geometry.of_kind(held.served, LINEAR) if i in held.held]
        states = len(linear) * 2 * geometry.state_slots * geometry.linear.state_bytes(itemsize(pool.dtype))
        return MlaStorage.pool_bytes(geometry.latent, pool, held) + states

    def exchange(self, placement_exchange: str) -> str:
        """The MLA layers store and attend through the mode's exchange, wrapped with the KDA
        layers' scan (graphcp.model.kimi_linear.exchange)."""
        return f"kda+{placement_exchange}"

    def state_pools(self) -> dict[str, torch.Tensor]:
        return self.states.pools()

    def read_span(self, pages: tuple[int, ...], layer: int, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """An MLA layer's positions ``[start, stop)`` as the export holds them
        (graphcp.model.kimi_linear.export): ``latent``, ``rope_key`` (when the model has a
        rope slice) and, in a layer that runs the pooled indexer, ``index_key`` and
        ``index_gate``."""
        parts = super().read_span(pages, layer, start, stop)
        out = (parts[0],) + ((parts[1],) if self.rope_dim else ())
        if len(parts) == 3:
            d = self.index_split
            out += (parts[2][:, :d].contiguous(), parts[2][:, d:].contiguous())
        return out

    def read_state(self, row: int, layer: int) -> tuple[torch.Tensor, ...]:
        """A KDA layer's ``conv`` ``[conv_dim, K]`` and float32 ``recurrent`` ``[H, d_k,
        d_v]`` (new tensors; the committed slot)."""
        s = self.states
        slot = s.committed_slot(row)
        j = s.linear_index[layer]
        return s.conv[j, slot].t().contiguous(), s.recurrent[j, slot].clone()


    def write_state(self, row: int, layer: int, values: tuple[torch.Tensor, ...]) -> None:
        """A KDA layer's ``conv`` ``[conv_dim, K]`` and ``recurrent`` (as :meth:`read_state`
        returns them) as the request's committed state (an import; a layer this rank keeps)."""
        conv, recurrent = values
        s = self.states
        slot = s.committed_slot(row)
        j = s.linear_index[layer]
        s.conv[j, slot] = conv.t().to(s.conv.dtype)
        s.recurrent[j, slot] = recurrent.to(torch.float32)


def linear_dims(num_heads: int, head_dim: int, conv_kernel: int) -> LinearDims:
    """A KDA layer's heads as the scan and the states count them: as many key heads as
    value heads, one head width."""
    return LinearDims(num_heads, num_heads, head_dim, head_dim, conv_kernel)
