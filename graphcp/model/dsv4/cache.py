"""The storage of a DeepSeek V4 model's cache (docs/dsv4.md): per layer kind,

- **window rows** (every layer): each token's K = V (``head_dim`` values, after the
  norm and RoPE), what the sliding window reads;
- **source rows** (compressed layers): each token's compressor projections before
  pooling (kv and gate: CSA two overlapping series of ``head_dim`` each, plus its
  indexer's two of ``index_head_dim``; HCA one series). They are what a later forward
  pools into the entries a window closes: the not-yet-compressed remainder and CSA's
  overlap state of transformers' cache are the source rows of a request's last
  ``2 m`` tokens;
- **compressed entries** (compressed layers): one entry of ``head_dim`` per ``m``
  tokens (and a CSA layer's indexer entry of ``index_head_dim``), written by the
  forward that closes its window.

All pools share the cache's allocator, page tables, slots and handles (graphcp.kv; page
0 is scratch). Token pools hold ``page_size`` rows a page. An entry pool holds
``epp = max(1, page_size / m)`` entries a page: entry ``e`` of a request lives in the
page that holds its first token (token ``e * m``), at ``e % epp``, so a request's pages
hold its entries too, and the entry pools are ``m`` times smaller than a token pool
(``page_size`` times when ``m > page_size``). The page size must divide ``m`` or be a
multiple of it.

Every token's window and source rows are kept: only the last ``sliding_window - 1``
window rows and the last ``2 m`` source rows are read again (docs/dsv4.md says what
releasing the older pages would save). :class:`DsV4Storage` holds the layers this rank
keeps (graphcp.kv.layers): every layer it serves (replicated over the CP ranks), or
under the layer split (``--kv-cache layer-split``) its own, with a scratch layer in each
pool some served layer of whose kind another rank keeps. The exchange writes a layer's
rows where the accessors point (its own slots on its owner, the scratch elsewhere); in
the attention break the owner broadcasts the batch's cached-prefix pages of every pool
of that layer before the pooling and attention read them: the same values as the
replicated cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcp.errors import ConfigError
from graphcp.kv.handle import KVHandle
from graphcp.kv.layers import HeldLayers, LayerSlots
from graphcp.kv.spec import CacheGeometry, PoolSpec
from graphcp.kv.storage.base import Storage, itemsize

#: a V4 layer's kind: a window only, the window + compressed sparse entries, + heavily compressed entries
SLIDING, CSA, HCA = "sliding", "csa", "hca"


@dataclass(frozen=True)
class DsV4CacheSpec(CacheGeometry):
    """What the cache and the attention break size by (graphcp.model.dsv4.config reads it)."""

    layer_kinds: tuple[str, ...]
    head_dim: int
    index_head_dim: int
    compress_csa: int  # m: tokens per CSA entry (its windows overlap: 2 m source tokens)
    compress_hca: int  # m': tokens per HCA entry

    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed entry of a compressed layer (0 for a sliding layer)."""
        kind = self.layer_kinds[layer]
        return self.compress_csa if kind == CSA else self.compress_hca if kind == HCA else 0

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == kind)

    def raw_width(self, layer: int) -> int:
        """Source values a token holds for a compressed layer's pooling: the compressor's
        kv and gate (CSA: two series each, 2 x head_dim) and a CSA indexer's (2 x
        index_head_dim each)."""
        kind = self.layer_kinds[layer]
        if kind == CSA:
            return 4 * self.head_dim + 4 * self.index_head_dim
        return 2 * self.head_dim if kind == HCA else 0


def entries_per_page(page_size: int, rate: int, where: str = "RuntimeConfig.page_size") -> int:
    """Entries a page of an entry pool holds (ConfigError when neither size divides the other)."""
    if rate <= page_size:
        if page_size % rate:
            raise ConfigError(f"{where}={page_size}: a DeepSeek V4 model's compress rate {rate} must divide the page "
                              "size (or be a multiple of it): entries are paged with the tokens they pool")
        return page_size // rate
    if rate % page_size:
        raise ConfigError(f"{where}={page_size}: must divide the compress rate {rate} of a DeepSeek V4 model "
                          "(entries are paged with the tokens they pool)")
    return 1


def layer_slots(cfg: DsV4CacheSpec, held: HeldLayers) -> dict[str | None, LayerSlots]:
    """Where each layer lives in each pool: the window pool (None: every layer) and each
    compressed kind's; a pool has a scratch layer when some served layer of its kind is
    kept by another rank."""
    out = {}
    for kind in (None, CSA, HCA):
        layers = [i for i in held.served if kind is None or cfg.layer_kinds[i] == kind]
        missing = any(i not in held.held for i in layers)
        out[kind] = LayerSlots(held, layers, scratch=held.split and missing, what=f"is not a {kind} layer")
    return out


class DsV4Storage(Storage):
    modes = ("replicated", "layer-split")

    def __init__(self, cfg: DsV4CacheSpec, pool: PoolSpec, held: HeldLayers) -> None:
        self.cfg, self.held = cfg, held
        self.num_pages, self.page_size = pool.num_pages, pool.page_size
        self.epp = {kind: entries_per_page(pool.page_size, rate) for kind, rate in ((CSA, cfg.compress_csa),
                                                                                  (HCA, cfg.compress_hca))}
        #: pool (None: the window pool; CSA / HCA: that kind's) -> where each layer lives in it
        self.slots = layer_slots(cfg, held)
        P, ps, hd, ihd = pool.num_pages, pool.page_size, cfg.head_dim, cfg.index_head_dim
        n_csa, n_hca = self.slots[CSA].depth, self.slots[HCA].depth

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=pool.dtype, device=pool.device)

        self.source_pools = {CSA: zeros(n_csa, P, ps, 4 * hd + 4 * ihd), HCA: zeros(n_hca, P, ps, 2 * hd)}
        self.entry_pools = {CSA: zeros(n_csa, P, self.epp[CSA], hd), HCA: zeros(n_hca, P, self.epp[HCA], hd)}
        self.index_pool = zeros(n_csa, P, self.epp[CSA], ihd)
        self.pool = zeros(self.slots[None].depth, P, ps, hd)

    @classmethod
    def create(cls, geometry: DsV4CacheSpec, pool: PoolSpec, held: HeldLayers) -> "DsV4Storage":
        return cls(geometry, pool, held)

    @classmethod
    def pool_bytes(cls, geometry: DsV4CacheSpec, pool: PoolSpec, held: HeldLayers) -> int:
        """Bytes of every pool (the engine checks the pools fit memory)."""
        c, ps = geometry, pool.page_size
        slots = layer_slots(c, held)
        n_win, n_csa, n_hca = slots[None].depth, slots[CSA].depth, slots[HCA].depth
        values = ps * (n_win * c.head_dim + n_csa * (4 * c.head_dim + 4 * c.index_head_dim) + n_hca * 2 * c.head_dim)
        values += (entries_per_page(ps, c.compress_csa) * n_csa * (c.head_dim + c.index_head_dim)
                   + entries_per_page(ps, c.compress_hca) * n_hca * c.head_dim)
        return pool.num_pages * values * itemsize(pool.dtype)

    def page_pools(self) -> dict[str, torch.Tensor]:
        return {"window": self.pool, "source_csa": self.source_pools[CSA], "source_hca": self.source_pools[HCA],
                "entries_csa": self.entry_pools[CSA], "entries_hca": self.entry_pools[HCA],
                "index_entries": self.index_pool}

    def kind(self, layer: int) -> str:
        return self.cfg.layer_kinds[layer]

    def token_values(self, layer: int) -> int:
        """Values a token's exchange row holds in ``layer``: its window row and source rows."""
        return self.cfg.head_dim + self.cfg.raw_width(layer)

    def window(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, head_dim]``: layer ``layer``'s window rows."""
        return self.pool[self.slots[None][layer]]

    def layer(self, i: int) -> torch.Tensor:
        return self.window(i)

    def sources(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, width]``: a compressed layer's source rows."""
        kind = self.kind(layer)
        return self.source_pools[kind][self.slots[kind][layer]]

    def entries(self, layer: int) -> torch.Tensor:
        """``[num_pages, epp, head_dim]``: a compressed layer's compressed entries."""
        kind = self.kind(layer)
        return self.entry_pools[kind][self.slots[kind][layer]]

    def index_entries(self, layer: int) -> torch.Tensor:
        """``[num_pages, epp, index_head_dim]``: a CSA layer's indexer entries."""
        return self.index_pool[self.slots[CSA][layer]]

    def layer_pools(self, layer: int) -> list[torch.Tensor]:
        kind = self.kind(layer)
        pools = [self.window(layer)]
        if kind in (CSA, HCA):
            pools += [self.sources(layer), self.entries(layer)]
        if kind == CSA:
            pools.append(self.index_entries(layer))
        return pools

    def write(self, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Scatter exchange rows ``[n, head_dim + source width]`` to token ``slots [n]``;
        slot -1 (padding) goes to the scratch page, so the write keeps a static shape."""
        s = slots.clamp(min=0)
        page, off = torch.div(s, self.page_size, rounding_mode="floor"), s % self.page_size
        hd = self.cfg.head_dim
        self.window(layer)[page, off] = rows[:, :hd]
        if self.kind(layer) in (CSA, HCA):
            self.sources(layer)[page, off] = rows[:, hd:]

    def read_span(self, pages: tuple[int, ...], layer: int, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        raise ValueError("a DeepSeek V4 cache is read whole a layer (graphcp.model.dsv4.source reads read_tokens)")

    # ---- slots of a request's rows (device tensors; ``pages``: its page ids, int64; or
    # ``[B, W]`` each row's, with ``[B, n]`` positions or entries: a decode step's requests) ----
    def token_slots(self, pages: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        return pages.gather(-1, torch.div(positions, ps, rounding_mode="floor")) * ps + positions % ps

    def entry_slots(self, layer: int, pages: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        m, epp = self.cfg.compress_rate(layer), self.epp[self.kind(layer)]
        page_index = torch.div(entries * m, self.page_size, rounding_mode="floor")
        return pages.gather(-1, page_index) * epp + entries % epp

    def read_tokens(self, handle: KVHandle, layer: int, window_from: int = 0,
                    sources_from: int = 0) -> dict[str, torch.Tensor]:
        """One request's cached state of one layer (a live handle of this cache's: the
        caller checks it; new tensors): ``window [T - window_from, head_dim]`` (the rows of
        positions ``[window_from, T)``), and in a compressed layer ``sources [T -
        sources_from, width]``, ``entries [T // m, head_dim]`` and (CSA) ``index_entries [T
        // m, index_head_dim]`` (graphcp.model.dsv4.source reads the last window and the
        last source rows only)."""
        dev = self.pool.device
        T = handle.num_tokens
        if not (0 <= window_from <= T and 0 <= sources_from <= T):
            raise ValueError(f"read_tokens: window_from={window_from} and sources_from={sources_from} must be in "
                             f"0..{T} (the request's tokens)")
        pages = torch.tensor(handle.pages, dtype=torch.long, device=dev)
        slots = self.token_slots(pages, torch.arange(window_from, T, device=dev))
        out = {"window": self.window(layer).flatten(0, 1).index_select(0, slots)}
        kind = self.kind(layer)
        if kind in (CSA, HCA):
            slots = self.token_slots(pages, torch.arange(sources_from, T, device=dev))
            out["sources"] = self.sources(layer).flatten(0, 1).index_select(0, slots)
            e = torch.arange(handle.num_tokens // self.cfg.compress_rate(layer), device=dev)
            es = self.entry_slots(layer, pages, e)
            out["entries"] = self.entries(layer).flatten(0, 1).index_select(0, es)
            if kind == CSA:
                out["index_entries"] = self.index_entries(layer).flatten(0, 1).index_select(0, es)
        return out
