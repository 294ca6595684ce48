"""The lightning indexer's scores and its top-k selection (DeepSeek Sparse Attention).

For query row ``i`` (its indexer query ``q_i`` of ``H_I`` heads, its head weights
``w_i``) and key token ``t`` (its indexer key ``k_t``):

    score(i, t) = sum_h w_ih * relu(scale * q_ih . k_t)

computed in float32 as transformers computes it (the same batched matmuls). Each row
keeps the ``index_topk`` best of the keys it may see (causal); a row that sees fewer
keeps them all.

Ties: a row's k-th best score may be shared by several keys (ReLU makes exact zeros
common: a key every head scores negative gets 0). The selection then takes the
earliest of the tied keys, so it is a function of the row's scores alone, never of
how many rows or keys a call happened to hold: whatever the CP size or layout, a row
selects the same tokens. (``torch.topk`` leaves the order of ties unspecified.)

Selections are int64 ``[rows, k]`` token positions in the request, ascending, ``-1``
where a row selects fewer than ``k``: the form sparse attention kernels take.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

#: a selection rule: (scores [B, kv] float32, -inf where a row may not look; k) -> positions [B, min(k, kv)]
Selector = Callable[[torch.Tensor, int], torch.Tensor]


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [B, H_I, D]``, ``w [B, H_I]`` (float32), ``k [kv, D]`` (or each row's own keys,
    ``[B, kv, D]``: a decode step's requests) -> float32 ``[B, kv]``."""
    s = F.relu(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale)  # [B, H_I, kv]
    return torch.matmul(w.float().unsqueeze(1), s).squeeze(1)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best visible keys of each row (ties: the earliest), as positions."""
    kv = scores.shape[1]
    visible = scores > float("-inf")
    if k < kv:
        kth = scores.topk(k, dim=-1).values[:, -1:]  # the k-th best value (unique, whatever the tie order)
        above = scores > kth
        tied = scores == kth
        need = k - above.sum(dim=-1, keepdim=True)
        chosen = (above | (tied & (tied.cumsum(dim=-1) <= need))) & visible
    else:
        chosen = visible
    return mask_to_positions(chosen, min(k, kv))


def mask_to_positions(chosen: torch.Tensor, k: int) -> torch.Tensor:
    """bool ``[B, kv]`` with at most ``k`` True a row -> ascending positions ``[B, k]``, -1 padded."""
    order = torch.argsort(chosen.to(torch.int8), dim=-1, descending=True, stable=True)[:, :k]
    return torch.where(chosen.gather(1, order), order, -1)


def causal_positions(positions: torch.Tensor, k: int) -> torch.Tensor:
    """The selection of rows at ``positions [B]`` that see at most ``k`` tokens (they are
    not scored: they attend to every token up to their own position) -> ``[B, k]``, -1 padded."""
    cols = torch.arange(k, device=positions.device)
    return torch.where(cols.unsqueeze(0) <= positions.unsqueeze(1), cols, -1)


def positions_to_mask(positions: torch.Tensor, kv: int) -> torch.Tensor:
    """Positions ``[B, k]`` (-1 padded) -> bool ``[B, kv]``."""
    idx = torch.where(positions < 0, kv, positions)
    mask = torch.zeros(positions.shape[0], kv + 1, dtype=torch.bool, device=positions.device)
    return mask.scatter_(1, idx, True)[:, :kv]
