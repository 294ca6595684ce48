"""The exact merge of a decode step's partial attention over the ranks of a token-sharded
cache: each rank holds part of every request's keys, attends the step's query rows over
them and gives a partial output ``o_r`` and its log-sum-exp ``l_r`` per row and head;
``o = sum_r exp(l_r - l) o_r`` with ``l = log sum_r exp(l_r)`` is the attention over all
of them (graphcp.attention.ring.merge, float32).

Two ways to bring the partials together, for B rows, H heads of dimension D, output
elements of s bytes and a float32 LSE (4 bytes), over C ranks; bytes one rank receives
per layer:

- ``all-gather``: every rank gathers every rank's partials (one collective) and merges
  all B rows: ``(C - 1) B H (D s + 4)``;
- ``all-to-all``: rank r receives the partials of its ``b = ceil(B / C)`` rows from every
  rank, merges them, and the merged rows are all-gathered (two collectives, as vLLM's and
  TensorRT-LLM Helix's merges exchange): ``(C - 1) b H (D s + 4) + (C - 1) b H D s``.

The LSE travels with the output in one message: its float32 bits as output-dtype
elements (bfloat16: two a row and head). :func:`choose_merge` takes the fewer bytes.
"""

from __future__ import annotations

import torch

from graphcp.attention.ring.merge import merge_states

#: the ways to merge, and what ``RuntimeConfig.decode_merge`` may also say
MERGES = ("all-gather", "all-to-all")
LSE_BYTES = 4


def merge_bytes(kind: str, rows: int, heads: int, head_dim: int, cp_size: int, itemsize: int) -> int:
    """Bytes one rank receives per layer to merge ``rows`` rows of ``heads`` heads over
    ``cp_size`` ranks (the module doc's formulas; ``itemsize``: the output's element size)."""
    C = cp_size
    if C == 1 or rows == 0:
        return 0
    part = heads * (head_dim * itemsize + LSE_BYTES)
    if kind == "all-gather":
        return (C - 1) * rows * part
    if kind == "all-to-all":
        b = -(-rows // C)
        return (C - 1) * b * part + (C - 1) * b * heads * head_dim * itemsize
    raise ValueError(f"unknown decode merge {kind!r}; expected one of {MERGES}")


def choose_merge(setting: str, rows: int, heads: int, head_dim: int, cp_size: int, itemsize: int) -> str:
    """``setting`` itself, or for ``auto`` the merge that moves fewer bytes (the all-gather,
    one collective, when they tie)."""
    if setting != "auto":
        return setting
    gather = merge_bytes("all-gather", rows, heads, head_dim, cp_size, itemsize)
    a2a = merge_bytes("all-to-all", rows, heads, head_dim, cp_size, itemsize)
    return "all-to-all" if a2a < gather else "all-gather"


def _pack(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """[n, H, D] outputs and [n, H] float32 LSEs as one [n, H, D + w] tensor of the output's
    dtype (the LSE's bits, w = 4 / itemsize elements)."""
    return torch.cat([out, lse.float().unsqueeze(-1).contiguous().view(out.dtype)], dim=-1)


def _unpack(packed: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return packed[..., :head_dim], packed[..., head_dim:].contiguous().view(torch.float32).squeeze(-1)


def _merged(parts: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[C, n, H, D + w] partials of C ranks -> their merge, float32 [n, H, D]."""
    o, lse = _unpack(parts, head_dim)
    return merge_states(list(o.unbind(0)), list(lse.unbind(0)))[0]


def merge_all_gather(group, out: torch.Tensor, lse: torch.Tensor) -> int:
    """Merge ``out`` [B, H, D] with its ``lse`` [B, H] over ``group``, in place; the bytes
    this rank received."""
    C, B, D = group.size, out.shape[0], out.shape[2]
    mine = _pack(out, lse)
    every = group.all_gather_rows(mine)
    out.copy_(_merged(every.view(C, B, *mine.shape[1:]), D))
    return every.nbytes - mine.nbytes


def merge_all_to_all(group, out: torch.Tensor, lse: torch.Tensor) -> int:
    """:func:`merge_all_gather` as an all-to-all of each rank's ``ceil(B / C)`` rows (the
    last rank's padded with rows of LSE -inf), a merge of its own rows and an all-gather
    of the merged rows."""
    C, (B, H, D) = group.size, out.shape
    b = -(-B // C)
    if b * C != B:
        o = out.new_zeros((b * C, H, D))
        o[:B] = out
        l_ = lse.new_full((b * C, H), float("-inf"), dtype=torch.float32)
        l_[:B] = lse
        out_rows, lse_rows = o, l_
    else:
        out_rows, lse_rows = out, lse
    mine = _pack(out_rows, lse_rows)
    split = [b] * C
    parts = group.all_to_all_rows(mine, split, split)
    merged = _merged(parts.view(C, b, *mine.shape[1:]), D).to(out.dtype)
    every = group.all_gather_rows(merged)
    out.copy_(every[:B])
    return parts.nbytes * (C - 1) // C + every.nbytes - merged.nbytes


#: kind -> the merge
MERGE_FUNCTIONS = {"all-gather": merge_all_gather, "all-to-all": merge_all_to_all}
