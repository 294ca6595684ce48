"""DeepSeek V4 attention after the exchange: pooling, the lightning indexer and attention
over the window and the compressed entries (docs/dsv4.md), as transformers computes them.

Per layer, in the attention break (it reads the live batch on the host):

1. **pool** (compressed layers, every rank, the whole batch: the entries are part of
   the replicated cache): every entry whose window closes in this forward, from the
   source rows the exchange wrote (the cached prefix's included): CSA entry ``e`` pools
   the first series of tokens ``[(e-1) m, e m)`` with the second series of tokens
   ``[e m, (e+1) m)`` (a softmax over the ``2 m`` gates plus ``position_bias``; entry 0's
   first half has weight 0), HCA entry ``e`` the tokens ``[e m', (e+1) m')``; then the
   norm and RoPE at position ``e m`` (the compress RoPE), written to the entry pools.
   A CSA layer's indexer pools its own entries the same way;
2. **select** (CSA, this rank's rows only): a row at position ``p`` sees the entries
   ``e < (p + 1) // m``; past ``index_topk`` of them the indexer scores them
   (``sum_h w_h relu(q_h . k_e) / sqrt(index_head_dim)``) and keeps the top ``index_topk``;
3. **attend** (this rank's rows only): keys = values = the window rows of positions
   ``(p - sliding_window, p]`` plus the row's entries (HCA: all it sees; CSA: the
   selected), one learned sink per head in the softmax's denominator.

The work of steps 2 and 3 is the rank's own rows: ``forward_stats`` counts the rows
and (row, key) pairs each rank scored and attended, beside what one rank computes when
nothing is partitioned (every row of the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from graphcp.attention.base import Attention, AttentionMetadata, BatchRequests
from graphcp.attention.staging import to_device_packed
from graphcp.model.dsa.sparse import RowGroup, row_groups
from graphcp.model.dsv4.cache import CSA, HCA, SLIDING, DsV4CacheSpec, DsV4Storage

#: ForwardInfo.stats keys (per forward, summed over the layers)
STAT_INDEX_ROWS = "dsv4_indexer_rows"  # query rows this rank scored (CSA layers)
STAT_INDEX_PAIRS = "dsv4_indexer_pairs"  # (row, entry) pairs it scored
STAT_ATTN_ROWS = "dsv4_attention_rows"  # query rows it attended (every layer)
STAT_ATTN_PAIRS = "dsv4_attention_pairs"  # (row, key) pairs it attended: window keys + entries
REPLICATED = "_replicated"  # suffix: the same figure for one rank computing every row of the batch
#: rows a block of the reference attends at once, at most, and the bound on a block's
#: float32 scores (attention: heads x rows x keys; the indexer: its heads x rows x entries)
BLOCK_ROWS = 256
BLOCK_BYTES = 64 << 20


def rms_weighted(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """V4's weighted RMSNorm (``DeepseekV4RMSNorm``): float32 weight times the float32
    normalised rows, cast once to ``x``'s dtype."""
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rope_at(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """:func:`rope_tail` at ``positions`` of the tables ``cos``/``sin`` (float32 ``[positions, r / 2]``)."""
    return rope_tail(x, cos.index_select(0, positions).to(x.dtype), sin.index_select(0, positions).to(x.dtype))


def index_scores(iq: torch.Tensor, iw: torch.Tensor, ik: torch.Tensor, scale: float) -> torch.Tensor:
    """The indexer's scores of rows ``iq [n, H_I, D]`` (head weights ``iw [n, H_I]``) over
    entries ``ik [E, D]`` (or each row's own, ``[n, E, D]``: a decode step's requests):
    ``sum_h w_h relu(q_h . k_e) * scale``, float32 ``[n, E]``, as transformers sums them."""
    scores = F.relu(torch.matmul(iq.float(), ik.float().transpose(-1, -2))) * scale
    return (scores * iw.float().unsqueeze(-1)).sum(dim=1)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` in interleaved pairs
    (``cos``/``sin`` in ``x``'s dtype, broadcast to ``x``'s leading dims); the rotation in
    float32, cast back (``apply_rotary_pos_emb`` of transformers' V4)."""
    r = 2 * cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    c, s = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    rot = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope.float() * c + rot.float() * s).to(x.dtype)], dim=-1)


@dataclass(frozen=True)
class DsV4AttentionSpec:
    cache: DsV4CacheSpec
    num_heads: int
    sliding_window: int
    index_n_heads: int
    index_topk: int
    norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.cache.head_dim


@dataclass(frozen=True)
class PoolWeights:
    """A compressed layer's pooling weights (float32): ``position_bias [m, width]`` and
    the entries' norm weight, for its compressor and (CSA) its indexer."""

    bias: torch.Tensor
    norm: torch.Tensor
    index_bias: torch.Tensor | None = None
    index_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class PoolPlan:
    """This forward's closing entries of one layer kind: their source rows' token slots
    (``[E * span]``, entry-major), which of them are entry 0 (CSA: no previous window;
    indices, None when none is), their RoPE positions and their slots in the entry pools."""

    sources: torch.Tensor
    span: int
    first: torch.Tensor | None
    positions: torch.Tensor
    dest: torch.Tensor


@dataclass(frozen=True)
class DeviceGroup:
    """A row group's arrays on the device, sliced from the forward's one upload: its
    pages, its rows' positions, and (CSA) the rows the indexer scores (seeing more than
    ``index_topk`` entries; local indices), with their host copy ``scored_host``."""

    pages: torch.Tensor
    positions: torch.Tensor
    scored: torch.Tensor
    scored_host: np.ndarray


def ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``[lo[i], hi[i])`` for every i, concatenated (int64; whole-array, no loop)."""
    n = hi - lo
    return np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n - lo, n)


def pool(src: torch.Tensor, bias: torch.Tensor, norm: torch.Tensor, eps: float, width: int, overlap: bool,
         first: torch.Tensor | None) -> torch.Tensor:
    """Entries from their source rows. ``src [E, S, 2 width (CSA) or width, ...]``: the
    kv part then the gate part of each source token (CSA: ``S = 2 m``, the previous
    window's tokens then the entry's own; HCA: ``S = m``). ``first`` (CSA; None when no
    entry is entry 0): the entries with no previous window, whose first half gets weight
    0: their indices, or a bool ``[E]`` (a decode graph's, whose entries are its rows').
    -> ``[E, width]`` before RoPE."""
    if overlap:
        m = src.shape[1] // 2
        kv_parts, gate_parts = src[..., : 2 * width], src[..., 2 * width:]
        kv = torch.cat([kv_parts[:, :m, :width], kv_parts[:, m:, width:]], dim=1)
        gate = torch.cat([gate_parts[:, :m, :width] + bias[:, :width], gate_parts[:, m:, width:] + bias[:, width:]],
                         dim=1)
        if first is not None:
            if first.dtype != torch.bool:
                first = torch.zeros(kv.shape[0], dtype=torch.bool, device=kv.device).index_fill_(0, first, True)
            head = first.view(-1, 1, 1) & (torch.arange(2 * m, device=kv.device) < m).view(1, -1, 1)
            kv = kv.masked_fill(head, 0)
            gate = gate.masked_fill(head, float("-inf"))
    else:
        kv, gate = src[..., :width], src[..., width:] + bias
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    return rms_weighted((kv * weights).sum(dim=1), norm, eps)


class TorchDsV4Attention(Attention):
    """The reference of the attention break (host loops over each request's rows, in
    blocks; one matmul per block). Reads host metadata: breakable graphs only. An
    :class:`~graphcp.attention.base.Attention` that takes the cache: the family's layers
    call :meth:`forward` with its storage (``graphcp/model/dsv4/attention.py``)."""

    name = "torch"
    supports_full_graph = False
    #: the body passes the batch's requests to :meth:`prepare` (the pooling covers all of them)
    reads_batch = True
    #: what a decode graph captures in its place, given its bucket's static metadata
    #: (graphcp/model/dsv4/runtime.py sets it: sparse_decode.py's form)
    decode_form: Callable[["TorchDsV4Attention", AttentionMetadata], Attention] | None = None

    def __init__(self, spec: DsV4AttentionSpec, compress_cos: torch.Tensor, compress_sin: torch.Tensor,
                 layers: range | None = None) -> None:
        """``layers``: the layers it attends (a pipeline stage's; None: the model's)."""
        self.spec = spec
        self.layers = layers if layers is not None else range(len(spec.cache.layer_kinds))
        self.cos, self.sin = compress_cos, compress_sin  # float32 [positions, rope_dim / 2]
        self._groups: list[RowGroup] = []
        self._device_groups: list[DeviceGroup] = []
        self._batch = BatchRequests.none()
        self._plans: dict[str, PoolPlan | None] = {}
        self._stats: dict[str, int] = {}

    def decode_graph_attention(self, meta: AttentionMetadata) -> Attention:
        """A decode graph's form of this attention over its bucket's static metadata: every
        shape the bucket's (:attr:`decode_form`, graphcp/model/dsv4/sparse_decode.py)."""
        if self.decode_form is None:
            raise NotImplementedError(f"the {self.name} V4 attention has no decode graph form")
        return self.decode_form(self, meta)

    def prepare(self, meta: AttentionMetadata, requests: BatchRequests | None = None) -> None:
        self._groups = row_groups(meta)
        self._device_groups = self._upload_groups(meta.device)
        self._batch = requests if requests is not None else BatchRequests.none()
        self._plans: dict[str, PoolPlan | None] = {}
        self._stats = {STAT_INDEX_ROWS: 0, STAT_INDEX_PAIRS: 0, STAT_ATTN_ROWS: 0, STAT_ATTN_PAIRS: 0}

    def _upload_groups(self, device: torch.device | str) -> list[DeviceGroup]:
        """Every row group's pages, positions and CSA-scored rows, once a forward: every
        layer and block slices them (they were uploaded per layer and block, blocking)."""
        if not self._groups:
            return []
        m, topk = self.spec.cache.compress_csa, self.spec.index_topk
        scored = [np.flatnonzero((g.positions + 1) // m > topk) for g in self._groups]
        parts = [a for g, s in zip(self._groups, scored) for a in (g.pages, g.positions, s)]
        views = to_device_packed(parts, device)
        return [DeviceGroup(*views[3 * i: 3 * i + 3], s) for i, s in enumerate(scored)]

    # ---- 1. pooling ---------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rope_at(x, self.cos, self.sin, positions)

    def _pool_plan(self, kind: str, cache: DsV4Storage) -> PoolPlan | None:
        """Where this forward's closing entries of a layer kind come from and go (the same
        for every layer of the kind: made once a forward); None when none closes."""
        if kind in self._plans:
            return self._plans[kind]
        spec, b, ps = self.spec.cache, self._batch, cache.page_size
        m = spec.compress_csa if kind == CSA else spec.compress_hca
        lo, hi = b.prefix_lens // m, (b.prefix_lens + b.extend_lens) // m  # entries [lo, hi) close now
        plan = None
        if (hi > lo).any():
            dev = cache.pool.device
            req = np.repeat(np.arange(len(lo)), hi - lo)
            e = ranges(lo, hi)
            overlap = kind == CSA
            span = 2 * m if overlap else m
            start = (e - 1) * m if overlap else e * m
            pos = np.maximum(start[:, None] + np.arange(span)[None, :], 0)  # [E, S] (entry 0's first half: masked)
            pages = b.pages[req].astype(np.int64)
            src = np.take_along_axis(pages, pos // ps, axis=1) * ps + pos % ps
            entry_page = np.take_along_axis(pages, (e * m // ps)[:, None], axis=1)[:, 0]
            epp = cache.epp[kind]
            first = np.flatnonzero(e == 0) if overlap else np.zeros(0, dtype=np.int64)
            sources, first_t, positions, dest = to_device_packed([src.reshape(-1), first, e * m,
                                                              entry_page * epp + e % epp], dev)
            plan = PoolPlan(sources, span, first_t if first.size else None, positions, dest)
        self._plans[kind] = plan
        return plan

    def pool_new_entries(self, layer: int, cache: DsV4Storage, w: PoolWeights) -> None:
        """Every entry whose window this forward closes, for every request of the batch."""
        spec = self.spec.cache
        kind = spec.layer_kinds[layer]
        plan = self._pool_plan(kind, cache)
        if plan is None:
            return
        overlap, hd = kind == CSA, spec.head_dim
        src = cache.sources(layer).flatten(0, 1).index_select(0, plan.sources)
        src = src.view(-1, plan.span, spec.raw_width(layer))
        width = 4 * hd if overlap else 2 * hd
        entries = pool(src[..., :width], w.bias, w.norm, self.spec.norm_eps, hd, overlap, plan.first)
        cache.entries(layer).flatten(0, 1).index_copy_(0, plan.dest, self._rope(entries, plan.positions))
        if overlap:
            idx = pool(src[..., width:], w.index_bias, w.index_norm, self.spec.norm_eps, spec.index_head_dim, True,
                       plan.first)
            cache.index_entries(layer).flatten(0, 1).index_copy_(0, plan.dest, self._rope(idx, plan.positions))

    # ---- 2 and 3. this rank's rows ------------------------------------------------------------
    def forward(self, layer: int, q: torch.Tensor, index_q: torch.Tensor | None, index_w: torch.Tensor | None,
                sinks: torch.Tensor, cache: DsV4Storage, weights: PoolWeights | None, out: torch.Tensor) -> None:
        """Pool the closing entries, then attend ``q [rows, H, head_dim]`` (rotated) of this
        rank's rows; writes ``out [rows, H, head_dim]`` (padding rows: zeros)."""
        sp, cs = self.spec, self.spec.cache
        kind = cs.layer_kinds[layer]
        if kind != SLIDING:
            self.pool_new_entries(layer, cache, weights)
        out.zero_()
        dev = q.device
        window = cache.window(layer).flatten(0, 1)
        m = cs.compress_rate(layer)
        entries = cache.entries(layer).flatten(0, 1) if m else None
        index_entries = cache.index_entries(layer).flatten(0, 1) if kind == CSA else None
        heads = max(sp.num_heads, sp.index_n_heads if kind == CSA else 0)
        for g, dg in zip(self._groups, self._device_groups):
            pages = dg.pages
            # a block's keys, at most: its window span and the request's entries
            n_keys = sp.sliding_window + BLOCK_ROWS + ((int(g.positions[-1]) + 1) // m if m else 0)
            step = max(1, min(BLOCK_ROWS, BLOCK_BYTES // (4 * heads * n_keys)))
            for r0, r1 in _blocks(g.positions, sp.sliding_window, step):
                pos = g.positions[r0:r1]
                rows = slice(g.q0 + r0, g.q0 + r1)
                lo = max(0, int(pos[0]) - sp.sliding_window + 1)
                hi = int(pos[-1]) + 1
                key_pos = torch.arange(lo, hi, device=dev)
                keys = window.index_select(0, cache.token_slots(pages, key_pos))
                pos_t = dg.positions[r0:r1]  # (the forward's upload, sliced: no copy here)
                visible = (key_pos[None, :] <= pos_t[:, None]) & (key_pos[None, :] > pos_t[:, None] - sp.sliding_window)
                # the work, counted on the host (no device sync): window keys + the entries attended
                pairs = int(np.minimum(pos + 1, sp.sliding_window).sum())
                if m:
                    n_ent = hi // m
                    seen_np = (pos + 1) // m  # entries each row sees
                    seen = torch.div(pos_t + 1, m, rounding_mode="floor")
                    ent = torch.arange(n_ent, device=dev)
                    ent_mask = ent[None, :] < seen[:, None]
                    pairs += int(np.minimum(seen_np, sp.index_topk).sum() if kind == CSA else seen_np.sum())
                    if n_ent:
                        slots = cache.entry_slots(layer, pages, ent)
                        keys = torch.cat([keys, entries.index_select(0, slots)], dim=0)
                        if kind == CSA:
                            ent_mask = ent_mask & self.select(layer, g, dg, (r0, r1), pos, seen, index_q[rows],
                                                              index_w[rows], index_entries.index_select(0, slots))
                    visible = torch.cat([visible, ent_mask], dim=1)
                self._stats[STAT_ATTN_ROWS] += len(pos)
                self._stats[STAT_ATTN_PAIRS] += pairs
                out[rows] = attend_keys(q[rows], keys, visible, sinks, sp.head_dim ** -0.5).to(out.dtype)

    def select(self, layer: int, group: RowGroup, on_device: DeviceGroup, block: tuple[int, int], pos: np.ndarray,
               seen: torch.Tensor, iq: torch.Tensor, iw: torch.Tensor, ik: torch.Tensor) -> torch.Tensor:
        """[rows, entries]: the entries the indexer of ``layer`` keeps for each row of
        ``block`` (rows ``[r0, r1)`` of ``group``, whose arrays on the device are
        ``on_device``, at positions ``pos``; all it sees while they are at most ``index_topk``)."""
        topk, n = self.spec.index_topk, ik.shape[0]
        keep = torch.arange(n, device=ik.device)[None, :] < seen[:, None]
        seen_np = (pos + 1) // self.spec.cache.compress_csa
        r0, r1 = block
        lo, hi = np.searchsorted(on_device.scored_host, (r0, r1))  # the block's scored rows, found on the host
        scored = on_device.scored_host[lo:hi] - r0
        if n <= topk or scored.size == 0:
            return keep
        idx = on_device.scored[lo:hi] - r0
        scores = index_scores(iq[idx], iw[idx], ik, self.spec.cache.index_head_dim ** -0.5)  # [scored rows, entries]
        scores = scores.masked_fill(~keep[idx], float("-inf"))
        top = scores.topk(topk, dim=-1).indices
        chosen = torch.zeros_like(keep[idx]).scatter_(1, top, True)
        keep[idx] = chosen & keep[idx]
        self._stats[STAT_INDEX_ROWS] += int(scored.size)
        self._stats[STAT_INDEX_PAIRS] += int(seen_np[scored].sum())
        return keep

    def forward_stats(self, prefix_lens: np.ndarray, extend_lens: np.ndarray) -> dict[str, int]:
        """This forward's work on this rank and what one rank computes replicated (every
        row of the batch; the same for every layer of a kind, counted once a kind)."""
        sp, cs = self.spec, self.spec.cache
        p = ranges(prefix_lens, prefix_lens + extend_lens)  # every new row's position
        n = p.size
        window = int(np.minimum(p + 1, sp.sliding_window).sum())
        rep = dict.fromkeys(self._stats, 0)
        kinds = [cs.layer_kinds[i] for i in self.layers]
        for kind in set(kinds):
            layers = kinds.count(kind)
            attended = 0
            if kind in (CSA, HCA):
                seen = (p + 1) // (cs.compress_csa if kind == CSA else cs.compress_hca)
                attended = int(np.minimum(seen, sp.index_topk).sum()) if kind == CSA else int(seen.sum())
            if kind == CSA:
                scored = seen[seen > sp.index_topk]
                rep[STAT_INDEX_ROWS] += layers * scored.size
                rep[STAT_INDEX_PAIRS] += layers * int(scored.sum())
            rep[STAT_ATTN_ROWS] += layers * n
            rep[STAT_ATTN_PAIRS] += layers * (window + attended)
        return {**self._stats, **{k + REPLICATED: v for k, v in rep.items()}}


def work_report(stats_per_rank: list[dict]) -> str | None:
    """One line on V4's indexer and attention work per rank vs one rank computing every
    row (None: not a V4 forward)."""
    if not stats_per_rank or STAT_ATTN_ROWS not in stats_per_rank[0]:
        return None
    parts = []
    for key, what in ((STAT_INDEX_PAIRS, "indexer pairs"), (STAT_ATTN_PAIRS, "attention pairs")):
        rep = stats_per_rank[0][key + REPLICATED]
        shares = ", ".join(f"{s[key] / rep:.3f}" if rep else "0" for s in stats_per_rank)
        parts.append(f"{what} {shares} of {rep}")
    return "DeepSeek V4 work a rank (share of one rank computing every row): " + "; ".join(parts)


def _blocks(positions: np.ndarray, window: int, step: int) -> list[tuple[int, int]]:
    """Row blocks of a group: split where positions jump by more than the window (a
    zigzag rank's early and late chunks share no window key), at most ``step`` rows."""
    cuts = np.flatnonzero(np.diff(positions) > window) + 1
    out = []
    for a, z in zip(np.r_[0, cuts].tolist(), np.r_[cuts, positions.size].tolist()):
        out += [(r, min(z, r + step)) for r in range(a, z, step)]
    return out


def attend_keys(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor,
                scale: float) -> torch.Tensor:
    """``q [rows, H, D]`` over ``keys [K, D]`` (K = V; or each row's own, ``[rows, K, D]``:
    a decode step's requests) where ``visible [rows, K]``, one sink logit per head in the
    denominator; as transformers' eager V4 attention: logits in the activations' dtype, the
    softmax (max-shifted, the sink included) in float32. A row that sees no key: zeros."""
    own = keys.dim() == 3
    if own:
        logits = torch.matmul(q, keys.transpose(1, 2)).transpose(0, 1) * scale  # [H, rows, K]
    else:
        logits = torch.matmul(q.transpose(0, 1), keys.t()) * scale  # [H, rows, K]
    logits = logits.float().masked_fill(~visible.unsqueeze(0), float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(-1, logits.shape[1], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(keys.dtype)
    if own:
        return torch.matmul(probs.transpose(0, 1), keys)  # [rows, H, D]
    return torch.matmul(probs, keys).transpose(0, 1)  # [rows, H, D]
