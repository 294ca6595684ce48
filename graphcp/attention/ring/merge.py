"""Merging partial attention results by their log-sum-exp: the one merge both rings use.

Attention of a query row over keys split into blocks ``K_1 .. K_k`` is recovered
exactly from each block's normalised output ``o_i`` and natural-log LSE ``l_i``
(the contract of :mod:`graphcp.attention.base`):

    l = log(sum_i exp(l_i)),     o = sum_i exp(l_i - l) * o_i

computed in float32 with the largest ``l_i`` subtracted first, so any score
magnitude is safe. A block that a row does not touch carries ``l_i = -inf`` and
weight 0 (never NaN: the shift is 0 when every ``l_i`` is -inf). A row that no
block touches comes out as output 0 and LSE -inf; the ring plans refuse such
metadata before any kernel runs (every row sees at least its own key).
"""

from __future__ import annotations

from typing import Sequence

import torch


def merge_states(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``k`` partial results: ``outs[i]`` [n, H, D] (any float dtype) with
    ``lses[i]`` [n, H] (natural log; float32 or any float) into float32 ``(out, lse)``.

    ``out`` / ``lse_out`` (float32, [n, H, D] / [n, H]) receive the result and may be
    one of the inputs (a running merge: ``merge_states([acc, o], [acc_lse, l], acc,
    acc_lse)``): every input is read before they are written.
    """
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"merge_states needs as many outputs as LSEs, at least one; got {len(outs)} and {len(lses)}")
    lse = torch.stack([x.float() for x in lses])  # [k, n, H]
    top = lse.amax(dim=0)
    # rows every block leaves untouched: shift by 0, so exp(-inf - 0) = 0 and not NaN
    shift = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    w = torch.exp(lse - shift)  # [k, n, H]; 0 for untouched blocks
    total = w.sum(dim=0)
    merged_lse = shift + torch.log(total)  # -inf where no block touches the row
    w = w / torch.where(total > 0, total, torch.ones_like(total))
    acc = w[0].unsqueeze(-1) * outs[0].float()
    for i in range(1, len(outs)):
        acc.addcmul_(w[i].unsqueeze(-1), outs[i].float())
    if out is not None:
        acc = out.copy_(acc)
    if lse_out is not None:
        merged_lse = lse_out.copy_(merged_lse)
    return acc, merged_lse
