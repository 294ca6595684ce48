"""Grouped expert compute, and the reference it is tested against.

The routed (token, expert) pairs are sorted by expert, so each expert's rows are
contiguous; ``torch._grouped_mm`` then runs one matmul per expert over its rows,
reading the group ends from a device tensor. Shapes depend only on the number of
rows, never on the routing, so the same code runs inside a captured graph (the
``tp`` layout) and in the eager exchange break (``ep``). No Python loop over tokens
or experts.

Where ``torch._grouped_mm`` is sync-free: CPU (one op; the trace graph backend
replays it with the live group ends) and CUDA bfloat16 on compute capability 9.x /
10.x (its CUTLASS kernel: torch's ``_scaled_mm_allowed_device(sm90_only, sm100_only)``
takes the major only, so SM103 too). Elsewhere on CUDA (float32, other architectures)
it falls back to a loop that copies the group ends to the host: correct eagerly, not
inside a CUDA graph (:func:`grouped_mm_sync_free`).

Inside a CUDA graph. PyTorch issue 169970 reports an illegal memory access at *replay*
of ``torch._grouped_mm`` on H100/H200 with torch >= 2.9. Until graphcp's GPU check has
replayed a MoE layer whose routing changes between replays against eager
(``graphcp gpu-check``, part ``moe_graph``) and :data:`GROUPED_MM_GRAPHS_VALIDATED` is
set from that report, the ``tp`` layout's experts are not captured on CUDA
(:func:`grouped_mm_capturable`): breakable graphs run them in the attention break,
eagerly, as ``ep`` runs its exchange (``DecoderModel.hold_experts_out_of_graphs``), and a
full graph with ``moe='tp'`` is refused there.

:func:`reference_moe` is the plain form (a loop over experts with masks, as
transformers computes it) that the tests and the benchmark compare with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphcp.model.layers import swiglu

#: CUDA major versions whose torch._grouped_mm kernel reads the group ends on the device
#: (torch's ``_scaled_mm_allowed_device(sm90_only, sm100_only)``: major 9 or 10), bfloat16 only
SYNC_FREE_MAJORS = (9, 10)
#: whether a captured torch._grouped_mm has replayed correctly on a GPU (pytorch issue
#: 169970): set only from a passing ``moe_graph`` part of the GPU check
GROUPED_MM_GRAPHS_VALIDATED = False


class Experts(nn.Module):
    """The SwiGLU weights of ``num_local`` experts in the Hub layout, stacked: ``gate_up``
    ``[E_local, 2 I, hidden]`` (each expert's gate rows, then its up rows) and ``down``
    ``[E_local, hidden, I]``; ``I`` is a TP shard of the expert's intermediate size in
    the ``tp`` layout. ``first``: the global index of local expert 0."""

    def __init__(self, num_local: int, hidden: int, intermediate: int, first: int, dtype: torch.dtype,
                 limit: float | None = None) -> None:
        super().__init__()
        self.num_local, self.intermediate, self.first = num_local, intermediate, first
        #: DeepSeek V4's swiglu_limit: gate clamped above, up both ways, before the SwiGLU (None: no clamp)
        self.limit = limit
        self.gate_up = nn.Parameter(torch.empty(num_local, 2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_local, hidden, intermediate, dtype=dtype), requires_grad=False)

    def forward(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """``rows [M, hidden]`` sorted by local expert, ``ends`` int32 ``[E_local]`` the
        cumulative row counts (``ends[-1] == M``) -> each row through its expert."""
        h = torch._grouped_mm(rows, self.gate_up.transpose(1, 2), offs=ends)
        act = swiglu(h[:, : self.intermediate], h[:, self.intermediate:], self.limit)
        return torch._grouped_mm(act, self.down.transpose(1, 2), offs=ends)



def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs ``ids [n, k]`` (flattened token-major: pair ``p`` is token ``p // k``, slot
    ``p % k``) -> ``order``, the pairs sorted by expert (stable: token order within an
    expert), and int32 ``ends [num_experts]``, each expert's cumulative pair count.
    Static shapes: it runs inside captured graphs."""
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    experts = torch.arange(num_experts, device=ids.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    return order, ends


def unsort(sorted_rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows in sorted position ``i`` -> position ``order[i]`` (the inverse of ``rows[order]``)."""
    return torch.empty_like(sorted_rows).index_copy_(0, order, sorted_rows)


def combine(pair_rows: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weighted sum of each token's k expert outputs: ``pair_rows [n * k, hidden]``
    in pair order, ``weights [n, k]`` -> ``[n, hidden]`` in ``dtype``. As transformers
    forms it: each product in the weights' dtype, cast to ``dtype``, added in slot
    (ascending expert) order in ``dtype``; always on the token's own rows, so the
    result does not depend on which rank computed which expert."""
    n, k = weights.shape
    y = pair_rows.view(n, k, pair_rows.shape[-1])
    acc = (y[:, 0] * weights[:, :1]).to(dtype)
    for j in range(1, k):
        acc = acc + (y[:, j] * weights[:, j : j + 1]).to(dtype)
    return acc


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Every routed pair of ``x``'s rows through local experts that hold all
    ``num_experts`` (the ``tp`` layout, or one rank): sort, grouped compute, unsort,
    weighted sum. ``[n, hidden]`` in ``x``'s dtype (a TP partial sum in ``tp``)."""
    k = ids.shape[1]
    order, ends = sort_by_expert(ids, experts.num_local)
    out = experts(x.index_select(0, torch.div(order, k, rounding_mode="floor")), ends)
    return combine(unsort(out, order), weights, x.dtype)


def reference_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """The plain form, transformers' loop: for each expert, the tokens that picked it
    (a mask), its SwiGLU, the weighted rows added to theirs (``index_add_``, in the
    model's dtype, experts in ascending order). ``gate_up``/``down`` hold every expert."""
    out = torch.zeros_like(x)
    inter = down.shape[2]
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel() == 0:
            continue
        h = F.linear(x[token], gate_up[e])
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], down[e])
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out


def grouped_mm_sync_free(device: torch.device, dtype: torch.dtype,
                         capability: tuple[int, int] | None = None) -> bool:
    """Whether :class:`Experts` runs without a host sync on ``device`` in ``dtype``
    (torch's CUTLASS path). ``capability``: the CUDA device's (read from the device when None)."""
    if device.type != "cuda":
        return True
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    return dtype == torch.bfloat16 and tuple(capability)[0] in SYNC_FREE_MAJORS


def grouped_mm_capturable(device: torch.device, dtype: torch.dtype,
                          capability: tuple[int, int] | None = None,
                          validated: bool | None = None) -> bool:
    """Whether :class:`Experts` may sit inside a captured graph on ``device``: sync-free,
    and on CUDA only once a captured replay has been validated on a GPU (``validated``:
    None reads :data:`GROUPED_MM_GRAPHS_VALIDATED`; the GPU check passes True)."""
    if device.type != "cuda":
        return True
    ok = GROUPED_MM_GRAPHS_VALIDATED if validated is None else validated
    return ok and grouped_mm_sync_free(device, dtype, capability)
