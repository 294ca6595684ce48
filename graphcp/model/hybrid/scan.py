"""The linear layers under CP: what a rank computes, exchanges and stores for one
forward (docs/hybrid.md).

A request's new tokens are cut into *blocks* by the layout: zigzag's ``2C`` (rank
``r`` holds blocks ``r`` and ``2C-1-r``); on one rank, the whole request. Per linear layer:

1. **convolution halo**: a token's window is its ``K - 1`` predecessors. A block's
   first rows take them from the blocks before it (each rank's blocks' last ``K``
   pre-convolution rows, all-gathered: ``C x 2R x K`` rows) or from the cached conv
   state (a request's first block): the *halo source*.
2. **local pass**: each rank runs its blocks through the chunked gated delta rule
   with the augmented state (graphcp.model.hybrid.gdn): a block's map ``S_out = X S_in
   + Y`` and every token's output as a function of ``S_in``; a request's first block
   from its known incoming state (the prefix's, or zero).
3. **scan**: the maps are all-gathered (``C x 2R`` of ``[Hv, d_k, d_k + d_v]``, no
   matter how long the requests are) and every rank composes, per request in block
   order, each block's incoming state; its tokens' outputs are ``p S_in + o0``.
4. **store**: every rank has every request's final state and conv rows; the cache
   keeps them (the layer's owner only, under the layer split).

On one rank nothing is exchanged and a request is one block run from its known state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphcp.attention.staging import to_device_packed
from graphcp.cp import Plan
from graphcp.model.hybrid.gdn import CHUNK, augmented_rule
from graphcp.model.hybrid.kernels import TORCH, LinearKernels
from graphcp.model.hybrid.varlen import ChunkSlots, ConvRows, FlaSegments, SlotPlan, chunk_indices, conv_rows

#: a ForwardInfo.stats key: bytes a rank sent per linear layer (its tails and maps), summed over the layers
STAT_LINEAR_SENT = "linear_scan_bytes_sent"


@dataclass
class LinearPlan:
    """One forward's linear-layer plan on this rank (host arrays; every rank builds the
    same request-level parts). A rank's blocks are consecutive runs of its live rows, in
    order: ``cu`` bounds them (graphcp.model.hybrid.varlen)."""

    cp_size: int
    rows: int  # this rank's live rows
    num_requests: int
    num_local: int  # this rank's blocks (every rank has as many: 2R under zigzag, R on one rank)
    read: np.ndarray  # [R] the prefix's state slot (-1: none)
    write: np.ndarray  # [R] the slot this forward writes
    block_request: np.ndarray  # [nb] request of each local block
    block_index: np.ndarray  # [nb] its place in its request's blocks (0: the first)
    cu: np.ndarray  # [nb + 1] each local block's bounds in this rank's live rows
    halo: np.ndarray  # [nb, K - 1] the K - 1 pre-convolution rows before each local block, in the halo source
    tails: np.ndarray  # [nb, K] each local block's last K rows, right-aligned (rows: zero)
    final_conv: np.ndarray  # [R, K] each request's last K pre-convolution rows in the halo source
    compose: np.ndarray  # [R, blocks] each request's blocks in the gathered maps (rank * nb + local)

    @property
    def empty(self) -> bool:
        return self.num_requests == 0

    @property
    def maps(self) -> bool:
        """Whether some block's incoming state is unknown until the scan (CP > 1)."""
        return self.compose.shape[1] > 1

    @property
    def source_rows(self) -> int:
        """Rows of the halo source (the prefixes' conv rows, every rank's tails, a zero
        row): the convolution's source holds the live rows after them."""
        K = self.tails.shape[1]
        return self.num_requests * K + self.cp_size * self.num_local * K + 1

    @classmethod
    def inert(cls, cp_size: int) -> "LinearPlan":
        """A batch without rows (what a graph is captured with): the layers skip it."""
        z = np.zeros(0, dtype=np.int64)
        two = np.zeros((0, 1), dtype=np.int64)
        return cls(cp_size, 0, 0, 0, z, z, z, z, np.zeros(1, np.int64), two, two, two, two)

    @classmethod
    def build(cls, plan: Plan, rank: int, read: np.ndarray, write: np.ndarray, kernel: int) -> "LinearPlan":
        """This rank's plan of a zigzag ``plan`` (``read``/``write``: the requests' slots)."""
        C, R = plan.cp_size, plan.num_requests
        rp = plan.rank(rank)
        cu = rp.cu_seqlens_q.astype(np.int64)
        ext = plan.extend_lens
        if C == 1:  # a request is one block: its two zigzag segments are adjacent
            lengths, cu = ext[:, None].copy(), cu[0::2].copy()
            location = np.arange(R, dtype=np.int64)[:, None]
            local_req, local_k = np.arange(R, dtype=np.int64), np.zeros(R, dtype=np.int64)
        else:
            k = np.arange(2 * C, dtype=np.int64)
            lengths = (ext[:, None] + (2 * C - 1 - k)[None, :]) // (2 * C)  # [R, 2C]
            owner = np.where(k < C, k, 2 * C - 1 - k)
            location = owner[None, :] * (2 * R) + 2 * np.arange(R)[:, None] + (k >= C)[None, :]
            local_req = np.arange(2 * R, dtype=np.int64) // 2
            local_k = np.where(np.arange(2 * R) % 2 == 0, rank, 2 * C - 1 - rank)
        n = rp.num_rows
        tails = _tails(cu[:-1], np.diff(cu), n, kernel)
        source = _HaloSource(C, R, len(local_req), plan.prefix_lens > 0, lengths, location, kernel)
        halo = source.rows(lengths.cumsum(axis=1) - lengths, kernel - 1)  # [R, blocks, K-1]
        final = source.rows(ext[:, None], kernel)[:, 0]  # the last K rows before position ext: [R, K]
        return cls(C, n, R, len(local_req), read, write, local_req, local_k, cu, halo[local_req, local_k], tails,
                   final, location)


def _tails(starts: np.ndarray, lengths: np.ndarray, n: int, kernel: int) -> np.ndarray:
    """Each block's last ``kernel`` rows, right-aligned (``n``: a zero row before a short block)."""
    back = np.arange(kernel - 1, -1, -1, dtype=np.int64)[None, :]  # rows from the block's end
    row = (starts + lengths)[:, None] - 1 - back
    return np.where(back < lengths[:, None], row, n)


class _HaloSource:
    """Where a position's pre-convolution row is in the halo source: ``[R x K]`` the
    prefixes' conv rows, then ``[C x nb x K]`` every rank's blocks' tails, then a zero row."""

    def __init__(self, cp_size: int, num_requests: int, num_local: int, prefixed: np.ndarray, lengths: np.ndarray,
                 location: np.ndarray, kernel: int) -> None:
        self.R, self.K, self.prefixed = num_requests, kernel, prefixed
        self.lengths, self.location = lengths, location
        self.tails = num_requests * kernel
        self.zero = self.tails + cp_size * num_local * kernel

    def rows(self, ends: np.ndarray, count: int) -> np.ndarray:
        """``[R, E, count]``: the ``count`` rows before each request's new-token offset
        ``ends[j, e]`` (oldest first)."""
        R, K = self.R, self.K
        o = ends[:, :, None] - count + np.arange(count, dtype=np.int64)[None, None, :]
        j = np.broadcast_to(np.arange(R, dtype=np.int64)[:, None, None], o.shape)
        prefix = np.where(self.prefixed[j], j * K + K + o, self.zero)  # o < 0: the cached conv rows
        stop = self.lengths.cumsum(axis=1)  # [R, blocks]: each block's end offset
        blk = np.empty(o.shape, dtype=np.int64)
        for r in range(R):  # the block holding each offset (searchsorted per request)
            blk[r] = np.searchsorted(stop[r], np.maximum(o[r], 0), side="right")
        blk = np.minimum(blk, stop.shape[1] - 1)
        back = stop[j, blk] - 1 - o  # rows from the block's end
        tail = self.tails + self.location[j, blk] * K + (K - 1 - back)
        return np.where(o < 0, prefix, tail)


class LinearScan:
    """One forward's linear-layer work on this rank (device side of a :class:`LinearPlan`):
    what each linear layer's break calls. ``states``: the hybrid cache's
    (graphcp.model.hybrid.cache.LinearStates), ``group``: the CP group, ``kernels``: the
    local pass's (graphcp.model.hybrid.kernels; a float32 model's rule is the torch one).
    The plan's arrays and the layouts the kernels read go to the device in one packed
    upload (graphcp.attention.staging)."""

    def __init__(self, plan: LinearPlan, states, group, device: torch.device,
                 kernels: LinearKernels = TORCH) -> None:
        self.plan, self.states, self.group = plan, states, group
        self.kernels = kernels = kernels.for_dtype(states.conv.dtype)
        self._reads = bool((plan.read >= 0).any())
        self._upload(device)
        self.stats = {STAT_LINEAR_SENT: 0}

    def _upload(self, device: torch.device) -> None:
        """The plan's arrays and the kernels' layouts (graphcp.model.hybrid.varlen): one upload."""
        p, kernels = self.plan, self.kernels
        ext, seq, keep = conv_rows(p.cu, p.halo, p.source_rows)
        host = {"read": p.read, "write": p.write, "tails": p.tails, "final_conv": p.final_conv,
                "compose": p.compose, "block_request": p.block_request, "block_index": p.block_index,
                "known": p.block_index == 0, "ext": ext, "keep": keep}
        if kernels.conv.reads_seq:
            host["seq"] = seq
        slots = SlotPlan.build(p.cu, CHUNK) if kernels.rule.layout == "slots" else None
        if slots is not None:
            host.update(rows=slots.rows, position=slots.position, order=slots.order, inverse=slots.inverse)
        else:
            host.update(cu=p.cu, chunks=chunk_indices(p.cu, CHUNK))
        dev = {name: t.view(host[name].shape) for name, t in
               zip(host, to_device_packed(list(host.values()), device))}
        self.read, self.write, self.compose = dev["read"], dev["write"], dev["compose"]
        self.tails, self.final_conv = dev["tails"].view(-1), dev["final_conv"].view(-1)
        self.block_request, self.block_index, self.known = dev["block_request"], dev["block_index"], dev["known"].bool()
        seq_dev = dev["seq"].to(torch.int32) if "seq" in dev else None
        self.conv_rows = ConvRows(dev["ext"], seq_dev, dev["keep"], p.tails.shape[1])
        if slots is not None:
            self.layout = ChunkSlots(dev["rows"], dev["position"], dev["order"], dev["inverse"], slots.steps)
        else:
            self.layout = FlaSegments(dev["cu"], torch.from_numpy(p.cu), dev["chunks"])

    def convolve(self, layer: int, qkv: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The convolution (``weight`` ``[conv_dim, K]``) of this rank's pre-convolution rows
        ``qkv`` (live rows first): each block's halo from the blocks before it (every rank's
        last K rows, all-gathered) or the cached conv state; each request's last K rows become
        its new conv state. Returns the live rows' ``[rows, conv_dim]`` and the bytes received."""
        p, n, width = self.plan, self.plan.rows, qkv.shape[1]
        K = p.tails.shape[1]
        rows, zero = qkv[:n], qkv.new_zeros(1, width)
        tails = torch.cat([rows, zero]).index_select(0, self.tails).view(p.num_local, K, width)
        got = 0
        if p.cp_size > 1:
            gathered = self.group.all_gather_rows(tails)
            got = gathered.nbytes - tails.nbytes
            self.stats[STAT_LINEAR_SENT] += tails.nbytes
            tails = gathered
        (recurrent, conv), fetched = self.states.read_states(layer, self.read, self.group, self._reads)
        self._prefix = recurrent
        source = torch.cat([conv.reshape(-1, width), tails.reshape(-1, width), zero, rows])
        self._final_conv = source.index_select(0, self.final_conv).view(p.num_requests, K, width)
        return self.kernels.conv.fn(source, self.conv_rows, weight), got + fetched

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The gated delta rule over this rank's blocks (the convolution's rows ``q``, ``k``
        ``[rows, Hk, d_k]``, ``v`` ``[rows, Hv, d_v]``; float32 ``beta`` ``[rows, Hv]`` and
        log decays ``g``: ``[rows, Hv]``, or per key channel ``[rows, Hv, d_k]`` (KDA, with
        its own kernels: the update stays affine in the incoming state)), the blocks'
        states composed across ranks; stores every request's final state (after
        :meth:`convolve`). The outputs ``[rows, Hv, d_v]`` and the bytes received."""
        p = self.plan
        initial = self._prefix.index_select(0, self.block_request)
        got = 0
        if not p.maps:
            out, final_states = self._rule(q, k, v, g, beta, initial)
        else:
            pre, o0, x, y = augmented_rule(q, k, v, g, beta, initial, self.known, self._rule)
            incoming, final_states, got = self._scan(x, y)
            if self.kernels.rule.float32_outputs:
                out = self._outputs(pre, o0, incoming)
            else:  # p is rounded to the model's dtype: a second pass from the true states instead
                out, _ = self._rule(q, k, v, g, beta, incoming)
        self.states.write_states(layer, self.write, final_states, self._final_conv)
        return out, got

    def _rule(self, q, k, v, g, beta, initial) -> tuple[torch.Tensor, torch.Tensor]:
        if self.plan.rows == 0:  # no block has a row: each keeps its state (no kernel launch)
            return v.new_zeros(0, *v.shape[1:]), initial.clone()
        return self.kernels.rule.fn(q, k, v, g, beta, initial, self.layout)

    def _outputs(self, pre: torch.Tensor, o0: torch.Tensor, incoming: torch.Tensor) -> torch.Tensor:
        """Every row's ``p S_in + o0`` (float32), block by block (the bounds are on the host)."""
        out = torch.empty(o0.shape, dtype=torch.float32, device=o0.device)
        cu = self.plan.cu
        for b in range(self.plan.num_local):
            s, e = int(cu[b]), int(cu[b + 1])
            if e > s:
                out[s:e] = torch.einsum("thk,hkv->thv", pre[s:e].float(), incoming[b]) + o0[s:e]
        return out

    def _scan(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """All-gather the local blocks' maps, compose each request's blocks in order:
        every local block's incoming state and every request's final state."""
        maps = torch.cat([x, y], dim=-1)  # [nb, Hv, d_k, d_k + d_v]
        gathered = self.group.all_gather_rows(maps)
        self.stats[STAT_LINEAR_SENT] += maps.nbytes
        dk = x.shape[-1]
        incoming, final = compose(gathered[..., :dk], gathered[..., dk:], self.compose, self._prefix)
        return incoming[self.block_request, self.block_index], final, gathered.nbytes - maps.nbytes


def compose(xs: torch.Tensor, ys: torch.Tensor, order: torch.Tensor,
            initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan: every rank's blocks' maps ``S_out = X S_in + Y`` (``xs`` ``[C nb, Hv, d_k,
    d_k]``, ``ys`` ``[C nb, Hv, d_k, d_v]``, rank-major) composed per request in its blocks'
    order (``order`` ``[R, blocks]``: each block's row of the maps) from each request's
    incoming state ``initial`` (its first block ran from it already: X = 0, so the
    composition only carries it). Returns each block's incoming state ``[R, blocks, Hv,
    d_k, d_v]`` and each request's final state ``[R, Hv, d_k, d_v]``."""
    state = initial
    incoming = []
    for b in range(order.shape[1]):
        at = order[:, b]
        incoming.append(state)
        state = xs.index_select(0, at) @ state + ys.index_select(0, at)
    return torch.stack(incoming, dim=1), state
