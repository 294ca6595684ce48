"""The storage contract: what a token or a layer of a paged cache holds, and where.

A storage owns the tensors of one rank's cache: page pools (pages along dim 1, page 0
the scratch page, one pool layer per layer this rank keeps and, under the layer split,
one scratch layer: :class:`~graphcp.kv.layers.LayerSlots`) and, for a family that keeps
a recurrence's state per request, state pools in slots of a request's table row. It
knows nothing of which rank holds which tokens (the placement's) nor of free pages (the
allocator's): it writes rows to the slots it is given and reads the pages it is given.

A geometry (what a token holds: graphcp.kv.spec) has one storage class; the factory
builds it for any placement in its :attr:`Storage.modes`. :class:`Storage` gives the
defaults of a storage without per-request state.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import numpy as np
import torch

from graphcp.kv.handle import KVCacheFull
from graphcp.kv.layers import HeldLayers
from graphcp.kv.layout import KVLayout
from graphcp.kv.spec import CacheGeometry, PoolSpec

ALL_MODES = ("replicated", "sharded", "layer-split")


class RequestStates(Protocol):
    """Per-request state a storage keeps beside its pages, in slots of each request's
    table row (a recurrent layer's states): a reservation takes them, a rollback undoes it."""

    def admit(self, rows: np.ndarray) -> KVCacheFull | None:
        """After the pages of a batch in table ``rows`` were reserved: the refusal when a
        row has no state slots (nothing taken), else None with the rows' states taken."""

    def undo(self, rows: np.ndarray) -> None:
        """Give back what :meth:`admit` took for these rows (a rolled-back batch)."""

    def step_slots(self, rows: np.ndarray) -> np.ndarray:
        """int64 ``[2, B]``: the slot each request in table ``rows`` reads (its last
        forward's) and the one it writes, after :meth:`admit` took them for a decode step."""

    def keep_rows(self, step, keep: np.ndarray) -> None:
        """After a step of several rows a request (``step``: its DecodeSlots): request j's
        state becomes the one after its row ``keep[j] - 1`` (the rejected rows leave no trace)."""

    def written_slots(self, step) -> np.ndarray:
        """The state slots a decode step writes (what a decode graph's self-check compares)."""


class Storage:
    """One rank's tensors of a cache (module doc). A subclass builds them from a
    geometry, the pool and the layers this rank keeps, and implements the layer access,
    the write of an exchanged row and the reads of an export."""

    #: the cache modes (graphcp.kv.placement) this storage is built for
    modes: ClassVar[tuple[str, ...]] = ALL_MODES
    #: a page's order, for the attention backends that read :meth:`layer`
    layout: KVLayout = "NHD"
    #: layers whose per-request state (no pages) this storage keeps: an export reads them whole
    state_layers: frozenset[int] = frozenset()
    #: the per-request states a reservation takes (None: none)
    states: RequestStates | None = None
    #: the first of the page pools (what the capture and the tests read as the cache's pool)
    pool: torch.Tensor
    #: the layers this rank keeps (the placement's answer, :meth:`create`'s argument)
    held: HeldLayers

    @classmethod
    def create(cls, geometry: CacheGeometry, pool: PoolSpec, held: HeldLayers) -> "Storage":
        """This rank's storage of ``geometry``'s tokens in ``pool``, for the ``held`` layers."""
        raise NotImplementedError

    @classmethod
    def pool_bytes(cls, geometry: CacheGeometry, pool: PoolSpec, held: HeldLayers) -> int:
        """Bytes :meth:`create` allocates (page pools and state pools), without allocating."""
        raise NotImplementedError

    def exchange(self, placement_exchange: str) -> str:
        """The exchange (graphcp.attention.kv_exchange) a forward's layers store and attend
        through, given the placement's: the same unless some layers are not attention."""
        return placement_exchange

    def layer(self, i: int) -> torch.Tensor:
        """Global layer ``i``'s page pool (its own, or the scratch layer it is written to)."""
        raise NotImplementedError

    def layer_pools(self, layer: int) -> list[torch.Tensor]:
        """Every per-page tensor of ``layer`` (pages along dim 0): what a prefix fetch fills."""
        raise NotImplementedError

    def write(self, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Scatter exchanged rows ``[n, ...]`` (what :meth:`token_values` counts a token)
        of ``layer`` to ``slots [n]``; slot -1 (padding) goes to the scratch page."""
        raise NotImplementedError

    def token_values(self, layer: int) -> int:
        """Values one token holds in ``layer`` (what the exchange moves a token)."""
        raise NotImplementedError

    def page_pools(self) -> dict[str, torch.Tensor]:
        """Every tensor holding per-page data, pages along dim 1 (the capture self-check
        compares the pages a batch touched in each)."""
        raise NotImplementedError

    def state_pools(self) -> dict[str, torch.Tensor]:
        """Every tensor holding per-request state besides the pages: none here."""
        return {}

    def read_span(self, pages: tuple[int, ...], layer: int, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """A request's local indices ``[start, stop)`` of ``layer`` from its ``pages``, in
        the export format's tensors (new tensors; the cache is not changed)."""
        raise NotImplementedError

    def read_state(self, row: int, layer: int) -> tuple[torch.Tensor, ...]:
        """The committed state of the request in table ``row`` in a layer of
        :attr:`state_layers` (new tensors)."""
        raise ValueError(f"layer {layer} keeps no per-request state")

    # ---- an import (PrefillEngine.import_kv): the inverse of the export's reads ----------
    def write_span(self, layer: int, values: tuple[torch.Tensor, ...], slots: torch.Tensor) -> None:
        """Store ``values`` (the export format's tensors of ``layer``, as :meth:`read_span`
        returns them: this rank's heads, ``n`` tokens) at cache ``slots [n]`` (int64, on
        the pools' device): the positions of a request this rank holds."""
        raise NotImplementedError(f"{type(self).__name__} does not place an import")

    def write_state(self, row: int, layer: int, values: tuple[torch.Tensor, ...]) -> None:
        """Store a layer of :attr:`state_layers`' state (as :meth:`read_state` returns it)
        as the committed state of the request in table ``row`` (just reserved)."""
        raise ValueError(f"layer {layer} keeps no per-request state")


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
