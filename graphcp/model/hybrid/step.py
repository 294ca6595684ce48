"""A linear layer's decode step (docs/hybrid.md, "Decode"): one new row a request, the same
rows on every rank, so no scan. Per linear layer, on the ranks that keep its states
(every rank; under the layer split its owner, which broadcasts the layer's output):

1. the convolution: the request's conv state (its last ``K`` pre-convolution rows) read
   from its read slot, the new row shifted in, the window convolved;
2. the rule: the recurrent state read from the read slot, one token of the gated delta rule;
3. both new states written to the write slot (graphcp.model.hybrid.cache: the two slots
   a request keeps, flipped by the step's reservation and back by its rollback, so a
   failed step leaves every state as it was).

A step runs on a bucket's rows in a decode graph: everything here is device work of fixed
shape (no host read), so the graph captures it. A padding row reads and writes one slot
no live row writes, and keeps it as it was (graphcp.kv.decode.state_rows): its decay and
beta are zero, so the rule leaves its state bitwise, and its conv rows are kept.

A verify step (speculative decoding) gives each request ``n`` rows (its pending token and
the draft's, request-major): they advance the request's states one after the other, like a
short chunk, from its read slot. The last row's states go to the write slot (a step whose
rows are all kept needs nothing more) and every row's to the cache's per-row slots
(``LinearStates.row_pools``), from which the acceptance (``LinearStates.keep_rows``, called
by the cache's trim of the rejected rows) takes the state after each request's last kept
row: rejected rows leave no trace, and the read slot is never written.
"""

from __future__ import annotations

import torch

from graphcp.model.hybrid.step_kernels import TORCH_STEP, StepKernels


class LinearStep:
    """One decode step's linear-layer work on this rank (module doc). ``states``: the
    hybrid cache's (graphcp.model.hybrid.cache.LinearStates), ``slots``: ``[2, rows]`` each
    row's read and write slot, ``group``: the CP group."""

    def __init__(self, states, slots: torch.Tensor, group, kernels: StepKernels = TORCH_STEP, n: int = 1) -> None:
        self.states, self.group, self.kernels, self.n = states, group, kernels, n
        # a request's rows share its slots: one pair a request (group of n rows; a bucket's
        # last group may be padding rows only, whose slots keep what they hold)
        self.read, self.write = slots[0, ::n], slots[1, ::n]
        self._conv: tuple[torch.Tensor, torch.Tensor] | None = None

    def owner(self, layer: int) -> int | None:
        """The one rank that steps ``layer`` (None: every rank does)."""
        return self.states.held.owner(layer)

    def computes(self, layer: int) -> bool:
        owner = self.owner(layer)
        return owner is None or owner == self.group.rank

    def convolve(self, layer: int, qkv: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The convolution (``weight`` ``[conv_dim, K]``) of each row's ``qkv`` ``[rows,
        conv_dim]`` after its request's cached rows (SiLU applied)."""
        _, conv = self.states.layer_pools(layer)
        old = conv.index_select(0, self.read)
        if self.n > 1:
            return self._convolve_rows(qkv, old, weight, conv.dtype)
        out, new = self.kernels.conv(qkv, old, weight)
        self._conv = old, new.to(conv.dtype)
        return out

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, ...]`` as ``[groups, n, ...]`` (zero rows after the bucket's last)."""
        n, rows = self.n, x.shape[0]
        pad = self.read.shape[0] * n - rows
        if pad:
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
        return x.view(-1, n, *x.shape[1:])

    def _convolve_rows(self, qkv: torch.Tensor, old: torch.Tensor, weight: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
        """A verify step's convolution: each request's n rows after its cached rows, in one
        kernel call; the conv state after each row is the window it ends (kept for the
        acceptance)."""
        x = self._grouped(qkv)  # [G, n, C]
        out = self.kernels.conv_rows(x, old, weight)
        full = torch.cat([old, x.to(dtype)], dim=1)  # [G, K + n, C]
        K = old.shape[1]
        self._conv = old, torch.stack([full[:, i + 1: i + 1 + K] for i in range(self.n)], dim=1)  # [G, n, K, C]
        return out.reshape(-1, out.shape[-1])[: qkv.shape[0]]

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor) -> torch.Tensor:
        """One token of the rule (the convolution's ``q``, ``k`` ``[rows, Hk, d_k]`` and ``v``
        ``[rows, Hv, d_v]``, float32 ``g`` ``[rows, Hv]`` (or ``[rows, Hv, d_k]``: KDA's decay a
        key channel), ``beta`` ``[rows, Hv]``) from each request's
        state; writes both new states (after :meth:`convolve`). The outputs ``[rows, Hv,
        d_v]`` (float32, or v's dtype from fla)."""
        if self.n > 1:
            return self._run_rows(layer, q, k, v, g, beta)
        recurrent, conv = self.states.layer_pools(layer)
        # padding rows keep their slot as it was: no decay and no update leave the state
        # bitwise (S * exp(0) + k * 0), their conv rows are not shifted
        keep = self.read == self.write
        g = g.masked_fill(keep.view(-1, *(1,) * (g.dim() - 1)), 0.0)  # (a decay per head, or per key channel)
        beta = beta.masked_fill(keep[:, None], 0.0)
        keep = keep[:, None]
        out, new = self.kernels.rule(q, k, v, g, beta, recurrent.index_select(0, self.read))
        old_conv, new_conv = self._conv
        recurrent.index_copy_(0, self.write, new)
        conv.index_copy_(0, self.write, torch.where(keep[..., None], old_conv, new_conv))
        return out

    def _run_rows(self, layer: int, q, k, v, g, beta) -> torch.Tensor:
        """A verify step's rule: each request's n rows one after the other from its read
        slot's state (one kernel call a row); the last row's states to the write slot, every
        row's to the per-row slots (module doc)."""
        recurrent, conv = self.states.layer_pools(layer)
        rows = q.shape[0]
        q, k, v, g, beta = (self._grouped(t) for t in (q, k, v, g, beta))
        keep = (self.read == self.write)[:, None, None]  # padding groups: their slot as it was
        g, beta = g.masked_fill(keep, 0.0), beta.masked_fill(keep, 0.0)
        state = recurrent.index_select(0, self.read)
        outs, states = [], []
        for i in range(self.n):
            o, state = self.kernels.rule(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], state)
            outs.append(o)
            states.append(state)
        old_conv, windows = self._conv
        recurrent.index_copy_(0, self.write, state)
        conv.index_copy_(0, self.write, torch.where(keep, old_conv, windows[:, -1]))
        per_row = self.states.row_pools(layer, rows)
        if per_row is not None:
            per_row[0].copy_(torch.stack(states, dim=1).flatten(0, 1)[:rows])
            per_row[1].copy_(windows.flatten(0, 1)[:rows])
        return torch.stack(outs, dim=1).flatten(0, 1)[:rows]

    def share(self, layer: int, out: torch.Tensor) -> int:
        """Under the layer split, the owner's outputs ``out`` broadcast to every rank; the
        bytes this rank received."""
        owner = self.owner(layer)
        if owner is None:
            return 0
        self.group.broadcast_(out, owner)
        return 0 if self.group.rank == owner else out.nbytes
