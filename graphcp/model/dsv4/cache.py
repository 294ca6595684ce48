"""The paged cache of a DeepSeek V4 model (docs/dsv4.md): per layer kind,

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

All pools share :class:`PagedKVCache`'s allocator, page tables, slots and handles (page
0 is scratch). Token pools hold ``page_size`` rows a page. An entry pool holds
``epp = max(1, page_size / m)`` entries a page: entry ``e`` of a request lives in the
page that holds its first token (token ``e * m``), at ``e % epp``, so a request's pages
hold its entries too, and the entry pools are ``m`` times smaller than a token pool
(``page_size`` times when ``m > page_size``). The page size must divide ``m`` or be a
multiple of it.

Every token's window and source rows are kept: only the last ``sliding_window - 1``
window rows and the last ``2 m`` source rows are read again (docs/dsv4.md says what
releasing the older pages would save). :class:`DsV4KVCache` holds every layer it serves
(replicated over the CP ranks); :class:`LayerSplitDsV4KVCache` its own layers and a
scratch layer a pool (``--kv-cache layer-split``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcp.errors import ConfigError
from graphcp.kv.layer_split import LayerOwnership
from graphcp.kv.paged import KVHandle, PagedKVCache
from graphcp.kv.spans import owned_layers
from graphcp.kv.spec import PoolSpec

#: a V4 layer's kind: a window only, the window + compressed sparse entries, + heavily compressed entries
SLIDING, CSA, HCA = "sliding", "csa", "hca"


@dataclass(frozen=True)
class DsV4CacheSpec:
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


class DsV4KVCache(PagedKVCache):
    #: pools keep one scratch layer for the layers this rank does not hold (LayerSplit)
    scratch = False

    @classmethod
    def create(cls, geometry: DsV4CacheSpec, pool: PoolSpec) -> "DsV4KVCache":
        return cls(geometry, pool.num_pages, pool.page_size, pool.dtype, pool.device, pool.max_pages_per_seq,
                   pool.layers)

    @classmethod
    def held_of(cls, pool: PoolSpec) -> tuple[range, range | None]:
        """(the layers a rank's pools hold, the layers a split serves or None)."""
        return pool.layers, None

    @classmethod
    def pool_bytes_for(cls, geometry: DsV4CacheSpec, pool: PoolSpec) -> int:
        held, served = cls.held_of(pool)
        itemsize = torch.empty(0, dtype=pool.dtype).element_size()
        return pool.num_pages * cls.bytes_per_page(geometry, pool.page_size, itemsize, held, served)

    def __init__(self, cfg: DsV4CacheSpec, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", max_pages_per_seq: int | None = None,
                 layers: range | None = None, held: range | None = None) -> None:
        """``layers``: the global layers the cache serves (a pipeline stage's; None: the
        model's); ``held``: those whose pools this rank keeps (None: all of them)."""
        self.cfg = cfg
        self.layers = layers = layers if layers is not None else range(len(cfg.layer_kinds))
        self.epp = {kind: entries_per_page(page_size, rate) for kind, rate in ((CSA, cfg.compress_csa),
                                                                             (HCA, cfg.compress_hca))}
        held = layers if held is None else held
        #: pool -> global layer -> its index in the pool (None: the window pool; CSA / HCA: that kind's)
        self.index = {None: {i: j for j, i in enumerate(held)}}
        for k in (CSA, HCA):
            self.index[k] = {i: j for j, i in enumerate(x for x in held if cfg.layer_kinds[x] == k)}
        super().__init__(len(layers), num_pages, page_size, 1, cfg.head_dim, dtype, device, "NHD", max_pages_per_seq,
                         layers.start)

    def _scratch(self, kind: str | None) -> int:
        """Scratch layers a pool keeps: one when some layer it serves is not held here."""
        of_kind = [i for i in self.layers if kind is None or self.cfg.layer_kinds[i] == kind]
        return int(self.scratch and any(i not in self.index[kind] for i in of_kind))

    def _at(self, layer: int, kind: str | None) -> int:
        """``layer``'s index in a pool (the window's, or a kind's): its own, or the scratch."""
        held = self.index[kind]
        j = held.get(layer)
        if j is not None:
            return j
        if self.scratch and layer in self.layers:
            return len(held)
        raise IndexError(f"layer {layer} is not cached here: this cache serves layers "
                         f"{self.layers.start}..{self.layers.stop - 1}")

    @staticmethod
    def bytes_per_page(cfg: DsV4CacheSpec, page_size: int, itemsize: int, layers: range | None = None,
                       served: range | None = None) -> int:
        """Bytes one page takes in every pool holding ``layers`` (None: the model's); with
        ``served`` (LayerSplit: the layers the split covers) one scratch layer in each pool
        some served layer of whose kind is not held (the engine checks the pools fit memory)."""
        layers = list(layers if layers is not None else range(len(cfg.layer_kinds)))
        missing = [i for i in (served or ()) if i not in layers]
        n_csa = sum(cfg.layer_kinds[i] == CSA for i in layers) + any(cfg.layer_kinds[i] == CSA for i in missing)
        n_hca = sum(cfg.layer_kinds[i] == HCA for i in layers) + any(cfg.layer_kinds[i] == HCA for i in missing)
        layers += [None] * bool(missing)
        epp_csa = entries_per_page(page_size, cfg.compress_csa)
        epp_hca = entries_per_page(page_size, cfg.compress_hca)
        values = page_size * (len(layers) * cfg.head_dim
                              + n_csa * (4 * cfg.head_dim + 4 * cfg.index_head_dim) + n_hca * 2 * cfg.head_dim)
        values += epp_csa * n_csa * (cfg.head_dim + cfg.index_head_dim) + epp_hca * n_hca * cfg.head_dim
        return values * itemsize

    def _allocate_pool(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        c, P, ps = self.cfg, self.num_pages, self.page_size
        n_csa, n_hca = len(self.index[CSA]) + self._scratch(CSA), len(self.index[HCA]) + self._scratch(HCA)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.source_pools = {CSA: zeros(n_csa, P, ps, 4 * c.head_dim + 4 * c.index_head_dim),
                             HCA: zeros(n_hca, P, ps, 2 * c.head_dim)}
        self.entry_pools = {CSA: zeros(n_csa, P, self.epp[CSA], c.head_dim),
                            HCA: zeros(n_hca, P, self.epp[HCA], c.head_dim)}
        self.index_pool = zeros(n_csa, P, self.epp[CSA], c.index_head_dim)
        return zeros(len(self.index[None]) + self._scratch(None), P, ps, c.head_dim)

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
        return self.pool[self._at(layer, None)]

    def layer(self, i: int) -> torch.Tensor:
        return self.window(i)

    def sources(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, width]``: a compressed layer's source rows."""
        kind = self.kind(layer)
        return self.source_pools[kind][self._at(layer, kind)]

    def entries(self, layer: int) -> torch.Tensor:
        """``[num_pages, epp, head_dim]``: a compressed layer's compressed entries."""
        kind = self.kind(layer)
        return self.entry_pools[kind][self._at(layer, kind)]

    def index_entries(self, layer: int) -> torch.Tensor:
        """``[num_pages, epp, index_head_dim]``: a CSA layer's indexer entries."""
        return self.index_pool[self._at(layer, CSA)]

    def write(self, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Scatter exchange rows ``[n, head_dim + source width]`` to token ``slots [n]``;
        slot -1 (padding) goes to the scratch page, so the write keeps a static shape."""
        s = slots.clamp(min=0)
        page, off = torch.div(s, self.page_size, rounding_mode="floor"), s % self.page_size
        hd = self.cfg.head_dim
        self.window(layer)[page, off] = rows[:, :hd]
        if self.kind(layer) in (CSA, HCA):
            self.sources(layer)[page, off] = rows[:, hd:]

    # ---- slots of a request's rows (device tensors; ``pages``: its page ids, int64) ----------
    def token_slots(self, pages: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        return pages.index_select(0, torch.div(positions, ps, rounding_mode="floor")) * ps + positions % ps

    def entry_slots(self, layer: int, pages: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        m, epp = self.cfg.compress_rate(layer), self.epp[self.kind(layer)]
        page_index = torch.div(entries * m, self.page_size, rounding_mode="floor")
        return pages.index_select(0, page_index) * epp + entries % epp

    def read_tokens(self, handle: KVHandle, layer: int, window_from: int = 0,
                    sources_from: int = 0) -> dict[str, torch.Tensor]:
        """One request's cached state of one layer (new tensors): ``window [T - window_from,
        head_dim]`` (the rows of positions ``[window_from, T)``), and in a compressed layer
        ``sources [T - sources_from, width]``, ``entries [T // m, head_dim]`` and (CSA)
        ``index_entries [T // m, index_head_dim]`` (graphcp.pd's V4 export reads the last
        window and the last source rows only)."""
        self.check_handle(handle)
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


class LayerSplitDsV4KVCache(LayerOwnership, DsV4KVCache):
    """LayerSplit of a V4 cache (graphcp.kv.layer_split): each CP rank keeps every pool of
    its own layers (window rows, source rows, entries, a CSA layer's indexer entries) and
    one scratch layer in each. The exchange writes a layer's rows where the accessors
    point (its own slots on its owner, the scratch elsewhere); in the attention break the
    owner broadcasts the batch's cached-prefix pages of every pool of that layer before
    the pooling and attention read them: the same values as the replicated cache."""

    scratch = True

    @classmethod
    def create(cls, geometry: DsV4CacheSpec, pool: PoolSpec) -> "LayerSplitDsV4KVCache":
        return cls(geometry, pool.num_pages, pool.page_size, pool.dtype, pool.device, pool.max_pages_per_seq,
                   pool.rank, pool.cp_size, pool.layers)

    @classmethod
    def held_of(cls, pool: PoolSpec) -> tuple[range, range | None]:
        own = owned_layers(pool.rank, len(pool.layers), pool.cp_size)
        return range(pool.layers.start + own.start, pool.layers.start + own.stop), pool.layers

    def __init__(self, cfg: DsV4CacheSpec, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str, max_pages_per_seq: int | None, rank: int, cp_size: int,
                 layers: range | None = None) -> None:
        layers = layers if layers is not None else range(len(cfg.layer_kinds))
        self._split(len(layers), rank, cp_size, layers.start)
        super().__init__(cfg, num_pages, page_size, dtype, device, max_pages_per_seq, layers, self.owned)

    def layer_pools(self, layer: int) -> list[torch.Tensor]:
        kind = self.kind(layer)
        pools = [self.window(layer)]
        if kind in (CSA, HCA):
            pools += [self.sources(layer), self.entries(layer)]
        if kind == CSA:
            pools.append(self.index_entries(layer))
        return pools
