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
"""

from __future__ import annotations

import torch

from graphcp.model.hybrid.step_kernels import TORCH_STEP, StepKernels


class LinearStep:
    """One decode step's linear-layer work on this rank (module doc). ``states``: the
    hybrid cache's (graphcp.model.hybrid.cache.LinearStates), ``slots``: ``[2, rows]`` each
    row's read and write slot, ``group``: the CP group."""

    def __init__(self, states, slots: torch.Tensor, group, kernels: StepKernels = TORCH_STEP) -> None:
        self.states, self.group, self.kernels = states, group, kernels
        self.read, self.write = slots[0], slots[1]
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
        out, new = self.kernels.conv(qkv, old, weight)
        self._conv = old, new.to(conv.dtype)
        return out

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor) -> torch.Tensor:
        """One token of the rule (the convolution's ``q``, ``k`` ``[rows, Hk, d_k]`` and ``v``
        ``[rows, Hv, d_v]``, float32 ``g`` ``[rows, Hv]`` (or ``[rows, Hv, d_k]``: KDA's decay a
        key channel), ``beta`` ``[rows, Hv]``) from each request's
        state; writes both new states (after :meth:`convolve`). The outputs ``[rows, Hv,
        d_v]`` (float32, or v's dtype from fla)."""
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

    def share(self, layer: int, out: torch.Tensor) -> int:
        """Under the layer split, the owner's outputs ``out`` broadcast to every rank; the
        bytes this rank received."""
        owner = self.owner(layer)
        if owner is None:
            return 0
        self.group.broadcast_(out, owner)
        return 0 if self.group.rank == owner else out.nbytes
