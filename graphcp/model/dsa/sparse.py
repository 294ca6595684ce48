"""Sparse MLA attention of DSA models: the indexer's top-k and attention restricted to it.

The contract (:class:`SparseMlaBackend`) is :class:`graphcp.attention.base.Attention`'s
second kind, an attention that takes the cache, for models whose cache holds MLA's latent
(``graphcp/model/dsa/cache.py``): ``prepare`` once per forward (host side, the live
metadata), then per layer ``forward``, called by the family's layers in the attention
break with the cache's storage (``graphcp/model/dsa/mla.py``), which, for this rank's
query rows only,

1. in a layer that runs the indexer: scores each row against the indexer keys of its
   request in the cache (the cached prefix and every rank's new tokens, written by the
   exchange before the break), causal, and selects its top ``index_topk``
   (:mod:`graphcp.model.dsa.topk`); a layer that reuses an earlier layer's top-k
   (GLM's "shared" layers) takes the selection the last indexer layer made;
2. attends each row over its selected tokens only.

No rank scores another rank's rows: the indexer work of a rank is its own rows times
the keys each of them sees. ``forward_stats`` reports it per forward, with what one
rank scores when the indexer is replicated (every row of the batch): at C ranks a
rank's share is about 1/C of it.

Rows whose causal history holds at most ``index_topk`` tokens select all of it: they
are not scored (dense attention), as in transformers, where their top-k is every
visible token.

:class:`TorchSparseMla` is the reference: a loop on the host over each request's
rows (segments of one request on this rank, in any layout), in row blocks that bound
the float32 score memory; the selection becomes a mask; keys and values are
decompressed from the latent (``kv_b_proj``) for the tokens the block may see, then
one SDPA call. :class:`SelectingSparseMla` is the indexer side both share (row groups,
blocks, scoring, top-k, stats); ``graphcp/model/dsa/sparse_triton.py``'s kernel
backend gathers the selected rows of the paged latent instead (the selection's
``[rows, k]`` positions are the index form FlashMLA's sparse prefill takes). Both read
host metadata: in graph mode they run in the attention break.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from graphcp.attention.base import Attention, AttentionMetadata, BatchRequests
from graphcp.attention.staging import to_device_packed
from graphcp.model.dsa.cache import MlaStorage
from graphcp.model.dsa.topk import Selector, index_scores, positions_to_mask, select_topk

#: ForwardInfo.stats keys (per forward, summed over the layers that run the indexer)
STAT_ROWS = "indexer_query_rows"  # query rows this rank scored
STAT_PAIRS = "indexer_scored_pairs"  # (query row, key token) pairs this rank scored
STAT_REPLICATED = "indexer_replicated_pairs"  # the pairs one rank scores when the indexer is replicated
STAT_LAYERS = "indexer_layers"


@dataclass(frozen=True)
class SparseMlaSpec:
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    softmax_scale: float
    num_indexer_layers: int
    #: the indexer layers whose selection a later GLM 'shared' layer reuses (a decode step
    #: attended on one rank, the layer-split cache's, broadcasts it with the output)
    carries: frozenset[int] = frozenset()

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class RowGroup:
    """Consecutive local rows ``[q0, q1)`` of one request (its segments on this rank),
    at ascending ``positions``, reading the request's ``pages``."""

    q0: int
    q1: int
    positions: np.ndarray  # int64 [q1 - q0]
    pages: np.ndarray  # the request's pages covering positions[-1]


def row_groups(meta: AttentionMetadata) -> list[RowGroup]:
    """This rank's non-empty segments, merged while one continues the same request at
    later positions (zigzag's early and late blocks; interleave's one-row segments).
    Requests never share pages, so a request is its first page."""
    cu, kv_lens, table, ps = meta.cu_seqlens_q_host, meta.kv_lens_host, meta.page_table_host, meta.page_size
    groups: list[list] = []
    for s in range(meta.num_segments):
        q0, q1, kv = int(cu[s]), int(cu[s + 1]), int(kv_lens[s])
        if q1 == q0:
            continue
        pos = np.arange(kv - (q1 - q0), kv, dtype=np.int64)
        pages = table[s, : -(-kv // ps)]
        g = groups[-1] if groups else None
        if g is not None and g[1] == q0 and g[3][0] == pages[0] and g[2][-1][-1] < pos[0]:
            g[1], g[3] = q1, pages
            g[2].append(pos)
        else:
            groups.append([q0, q1, [pos], pages])
    return [RowGroup(q0, q1, np.concatenate(pos), pages) for q0, q1, pos, pages in groups]


def scored_pairs(positions: np.ndarray, topk: int) -> tuple[int, int]:
    """(rows, pairs) the indexer scores for rows at ``positions``: the rows that see
    more than ``topk`` tokens, each against the ``position + 1`` tokens it sees."""
    p = positions[positions >= topk]
    return int(p.size), int((p + 1).sum())


def replicated_pairs(prefix_lens: np.ndarray, extend_lens: np.ndarray, topk: int) -> int:
    """The pairs a replicated indexer scores on one rank (every row of the batch), one layer."""
    total = 0
    for pre, ext in zip(prefix_lens.tolist(), extend_lens.tolist()):
        lo, hi = max(pre, topk), pre + ext  # scored positions [lo, hi)
        if hi > lo:
            total += (hi * (hi + 1) - lo * (lo + 1)) // 2  # sum of (p + 1)
    return total


def indexer_report(stats_per_rank: list[dict]) -> str | None:
    """One line on the indexer's work per rank vs a replicated indexer (None: no indexer ran)."""
    if not stats_per_rank or STAT_PAIRS not in stats_per_rank[0]:
        return None
    rep = stats_per_rank[0][STAT_REPLICATED]
    if not rep:  # not "a share of 0": say why nothing was scored
        return "indexer: no key scored (no row sees more than index_topk keys: attention is dense)"
    shares = ", ".join(f"rank {r}: {s[STAT_ROWS]} rows, {s[STAT_PAIRS]} pairs"
                       + f" ({s[STAT_PAIRS] / rep:.3f})" for r, s in enumerate(stats_per_rank))
    return f"indexer (query rows x key tokens scored, share of the replicated indexer's {rep}): {shares}"


class SparseMlaBackend(Attention):
    """A DSA model's attention (an :class:`~graphcp.attention.base.Attention` that takes
    the cache: the family's layers call :meth:`forward` with its storage)."""

    name: str = "base"
    #: reads host metadata (the torch reference): never inside a captured graph
    supports_full_graph: bool = False
    #: what a decode graph captures in its place, given its bucket's static metadata
    #: (graphcp/model/dsa/runtime.py sets it: sparse_decode.py's form)
    decode_form: Callable[[SparseMlaSpec, AttentionMetadata], "SparseMlaBackend"] | None = None

    def __init__(self, spec: SparseMlaSpec) -> None:
        self.spec = spec

    @abstractmethod
    def prepare(self, meta: AttentionMetadata, requests: BatchRequests | None = None) -> None:
        """Host-side planning for this forward's live metadata (before any layer)."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, index_q: torch.Tensor | None, index_w: torch.Tensor | None,
                kv_b_weight: torch.Tensor, cache: MlaStorage, out: torch.Tensor) -> None:
        """Attend ``q [rows, H, qk_nope + qk_rope]`` (rope part rotated) over the cache,
        each row restricted to its top-k tokens; write ``out [rows, H, v_head_dim]``
        (padding rows: zeros). ``index_q [rows, H_I, D_I]`` and ``index_w [rows, H_I]``
        (float32, ``n_heads ** -0.5`` folded in) in a layer that runs the indexer, None in
        one that reuses the last selection. ``kv_b_weight``: ``kv_b_proj``'s weight."""

    @abstractmethod
    def forward_stats(self, prefix_lens: np.ndarray, extend_lens: np.ndarray) -> dict[str, int]:
        """This forward's indexer work (the STAT_* keys), given the batch's lengths."""

    def carried(self, layer: int, q: torch.Tensor) -> list[torch.Tensor]:
        """What a later layer reads of ``layer``'s attention besides its output (the
        ``[rows, index_topk]`` selection a GLM 'shared' layer reuses; none elsewhere): a
        phase that attends a layer on one rank broadcasts it with the output, into these
        tensors on every rank (graphcp.attention.phase.ExchangePhase.attend_own)."""
        return [self.selection_rows(q.shape[0], q.device)] if layer in self.spec.carries else []

    @abstractmethod
    def selection_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        """int64 ``[rows, index_topk]``: the last indexer layer's selection of each of this
        forward's rows (-1 where a row selects fewer; a row that is not scored: unread)."""

    def decode_graph_attention(self, meta: AttentionMetadata) -> "SparseMlaBackend":
        """A decode graph's form of this attention over its bucket's static metadata: every
        shape the bucket's (:attr:`decode_form`, graphcp/model/dsa/sparse_decode.py)."""
        if self.decode_form is None:
            raise NotImplementedError(f"the {self.name} sparse MLA attention has no decode graph form")
        return self.decode_form(self.spec, meta)


@dataclass(frozen=True)
class SelectedBlock:
    """Consecutive local ``rows`` of one request (``group``) and what they attend to:
    ``selection [rows, index_topk]`` positions (ascending, -1 padded), or None where
    every row sees at most ``index_topk`` tokens and attends to all of them (causal).
    ``kv``: the tokens the block's last row sees; ``pages``: the request's pages on the
    device; ``positions_on_device``: ``positions`` there (both slices of the forward's one
    upload)."""

    group: RowGroup
    rows: slice
    positions: np.ndarray  # int64 [rows]: each row's position in its request
    kv: int
    pages: torch.Tensor
    selection: torch.Tensor | None
    positions_on_device: torch.Tensor


class SelectingSparseMla(SparseMlaBackend):
    """The indexer's side of every backend (one home): the row groups, their blocks, the
    scoring and top-k of each block (or the selection the last indexer layer made, in a
    layer that reuses it) and the indexer stats. A subclass attends over what
    :meth:`selected_blocks` yields."""

    #: bound on a block's float32 scores (attention: heads x rows x keys; indexer: its heads)
    block_bytes = 64 << 20

    def __init__(self, spec: SparseMlaSpec, selector: Selector = select_topk) -> None:
        super().__init__(spec)
        #: the top-k rule (tests swap in a wrong one to show the selection matters)
        self.selector = selector
        self._groups: list[RowGroup] = []
        #: each group's pages and positions on the device: one upload a forward, sliced by the layers and blocks
        self._on_device: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: each local row's selection by the last indexer layer (made by the first one a forward)
        self._selected: torch.Tensor | None = None
        self._rows = self._pairs = 0

    def prepare(self, meta: AttentionMetadata, requests: BatchRequests | None = None) -> None:
        self._groups = row_groups(meta)
        views = to_device_packed([a for g in self._groups for a in (g.pages, g.positions)], meta.device) \
            if self._groups else []
        self._on_device = list(zip(views[0::2], views[1::2]))
        self._selected = None
        self._rows = self._pairs = 0

    def forward_stats(self, prefix_lens: np.ndarray, extend_lens: np.ndarray) -> dict[str, int]:
        layers = self.spec.num_indexer_layers
        return {STAT_LAYERS: layers, STAT_ROWS: self._rows, STAT_PAIRS: self._pairs,
                STAT_REPLICATED: layers * replicated_pairs(prefix_lens, extend_lens, self.spec.index_topk)}

    def selection_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        if self._selected is None:
            self._selected = torch.full((rows, self.spec.index_topk), -1, dtype=torch.long, device=device)
        return self._selected

    @property
    def groups(self) -> list[RowGroup]:
        """This forward's row groups (set by :meth:`prepare`)."""
        return self._groups

    def _blocks(self, g: RowGroup, heads: int) -> list[tuple[int, int]]:
        """Row blocks of a group: the rows that need no scoring first (they see at most
        index_topk tokens; positions ascend), then the rest, each block's scores within
        ``block_bytes``."""
        topk, pos = self.spec.index_topk, g.positions
        split = int(np.searchsorted(pos, topk))  # rows [0, split) see <= topk tokens
        out = []
        for a, b in ((0, split), (split, pos.size)):
            step = max(1, self.block_bytes // (4 * heads * (int(pos[b - 1]) + 1))) if b > a else 1
            out += [(r, min(b, r + step)) for r in range(a, b, step)]
        return out

    def selected_blocks(self, layer: int, index_q: torch.Tensor | None, index_w: torch.Tensor | None,
                        cache: MlaStorage, device: torch.device) -> Iterator[SelectedBlock]:
        """Every block of this forward's rows with its selection, scored here in a layer
        that runs the indexer (``index_q`` given), else the last indexer layer's."""
        sp = self.spec
        heads = max(sp.num_heads, sp.index_heads)
        for g, (pages, positions) in zip(self._groups, self._on_device):
            ik = None
            if index_q is not None:
                extent = int(g.positions[-1]) + 1
                ik = cache.index_keys(layer).index_select(0, pages).flatten(0, 1)[:extent]
            for b0, b1 in self._blocks(g, heads):
                kv = int(g.positions[b1 - 1]) + 1
                rows = slice(g.q0 + b0, g.q0 + b1)
                sel = None
                if int(g.positions[b0]) >= sp.index_topk:  # rows that see more than index_topk tokens
                    sel = self._select(layer, g.positions[b0:b1], positions[b0:b1], rows, index_q, index_w, ik, kv,
                                       device)
                yield SelectedBlock(g, rows, g.positions[b0:b1], kv, pages, sel, positions[b0:b1])

    def _select(self, layer: int, positions: np.ndarray, pos: torch.Tensor, rows: slice, index_q, index_w, ik,
                kv: int, device: torch.device) -> torch.Tensor:
        """A block's selection (its rows see more than index_topk tokens: ``[rows,
        index_topk]``): scored here (a layer that runs the indexer), or the one the last
        indexer layer made for the same rows (here, or broadcast by its holder)."""
        if index_q is None:
            if self._selected is None:
                raise RuntimeError(f"layer {layer} reuses the top-k of an earlier indexer layer, but none ran this "
                                   "forward")
            return self._selected[rows]
        sel = self.choose(layer, index_q[rows], index_w[rows], ik, pos, kv)
        self.selection_rows(index_q.shape[0], device)[rows] = sel
        n, pairs = scored_pairs(positions, self.spec.index_topk)
        self._rows += n
        self._pairs += pairs
        return sel


    def choose(self, layer: int, index_q: torch.Tensor, index_w: torch.Tensor, keys: torch.Tensor,
               pos: torch.Tensor, kv: int) -> torch.Tensor:
        """The selection ``[rows, index_topk]`` of rows at positions ``pos`` (each seeing
        more than index_topk tokens) over their request's indexer rows ``keys`` (the
        cache's, ``kv`` of them visible to the block's last row): the lightning indexer's
        best tokens. A family that scores other units (GLM-5-Next's pools) overrides it."""
        visible = torch.arange(kv, device=pos.device).unsqueeze(0) <= pos.unsqueeze(1)
        scores = index_scores(index_q, index_w, keys[:kv], self.spec.index_head_dim ** -0.5)
        return self.selector(scores.masked_fill(~visible, float("-inf")), self.spec.index_topk)


class TorchSparseMla(SelectingSparseMla):
    """The reference: per block, keys and values decompressed from the latent for the
    tokens the block may see, the selection as a mask, one SDPA call."""

    name = "torch"

    def forward(self, layer, q, index_q, index_w, kv_b_weight, cache, out) -> None:
        sp = self.spec
        out.zero_()
        dev = q.device
        group = keys = values = None
        for blk in self.selected_blocks(layer, index_q, index_w, cache, dev):
            if blk.group is not group:  # decompress a request's latent once for its blocks
                group = blk.group
                extent = int(group.positions[-1]) + 1
                lat = cache.latent(layer).index_select(0, blk.pages).flatten(0, 1)[:extent]
                keys, values = self._decompress(lat, kv_b_weight)
            pos = blk.positions_on_device
            mask = torch.arange(blk.kv, device=dev).unsqueeze(0) <= pos.unsqueeze(1)
            if blk.selection is not None:
                mask = mask & positions_to_mask(blk.selection, blk.kv)
            rows, kv = blk.rows, blk.kv
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0), keys[:kv].transpose(0, 1).unsqueeze(0),
                values[:kv].transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=sp.softmax_scale)
            out[rows] = o[0].transpose(0, 1).to(out.dtype)

    def _decompress(self, lat: torch.Tensor, kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows ``[kv, kv_lora + rope]`` -> per-head keys ``[kv, H, qk]`` (the
        decompressed no-rope part, then the shared rope key) and values ``[kv, H, v]``."""
        sp = self.spec
        n = lat.shape[0]
        kv = F.linear(lat[:, : sp.kv_lora_rank], kv_b_weight).view(n, sp.num_heads, -1)
        k_nope, values = kv.split([sp.qk_nope_head_dim, sp.v_head_dim], dim=-1)
        rope = lat[:, sp.kv_lora_rank:].unsqueeze(1).expand(n, sp.num_heads, sp.qk_rope_head_dim)
        return torch.cat([k_nope, rope], dim=-1), values
