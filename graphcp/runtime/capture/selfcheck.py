"""Capture self-check: replay a freshly captured bucket on a synthetic batch and
compare it, bitwise, with the same body run eagerly on the same bucket.

A captured graph keeps whatever capture saw: a Python scalar read from the
capture batch, a tensor built from host data outside the static buffers, a cast
the recorder skipped. The capture batch is inert (no row in any segment), so a
synthetic batch with real rows exposes all of them: several requests, one with a
cached prefix (attention over earlier pages), one shorter than 2C (empty zigzag
blocks), sized to fill the bucket as far as the KV pool allows. The outputs
compared are the body's rows and every KV page the batch touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcp.cp import Layout


@dataclass(frozen=True)
class SyntheticBatch:
    prefix_len: int  # tokens of request 0's cached prefix (0: none)
    extend_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.prefix_len + sum(self.extend_lens)


def synthetic_batch(
    capacity: int, layout: Layout, free_pages: int, page_size: int, max_requests: int, max_context: int
) -> SyntheticBatch | None:
    """The largest batch of this shape whose largest rank fits ``capacity`` rows and
    whose KV fits ``free_pages``; None when not even one token fits."""
    prefix = page_size + 3 if max_context > page_size + 4 else 0  # its last page is shared with new tokens
    total = layout.cp_size * capacity
    while total >= 1:
        short = min(2 * layout.cp_size - 1, total // 4)  # shorter than 2C: empty zigzag blocks
        rest = total - short
        first = min(rest - rest // 2, max_context - prefix)
        second = min(rest // 2, max_context) if max_requests > 1 else 0
        lens = tuple(n for n in (first, second, short if max_requests > 2 else 0) if n > 0)
        pages = -(-(prefix + lens[0]) // page_size) + sum(-(-n // page_size) for n in lens[1:])
        if lens and pages <= free_pages:
            plan = layout.plan(extend_lens=list(lens), prefix_lens=[prefix] + [0] * (len(lens) - 1))
            if plan.max_local_rows <= capacity:
                return SyntheticBatch(prefix, lens)
        total -= max(1, total // 8)
    if prefix and free_pages >= 2:  # too small a pool for a prefix: a fresh token or two
        return synthetic_batch(capacity, layout, free_pages, page_size, max_requests, 0)
    return None


def first_difference(outputs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """None when every (replayed, eager) pair is bitwise equal (NaN where both are
    NaN counts as equal), else which output differs: its rows along dim 0 (the
    body's rows; the layer for the KV pool) and the largest difference."""
    for name, (got, want) in outputs.items():
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{name} is {tuple(got.shape)} {got.dtype}, the eager body's {tuple(want.shape)} {want.dtype}"
        ne = (got != want) & ~(got.isnan() & want.isnan())
        if bool(ne.any()):
            rows = ne.reshape(ne.shape[0], -1).any(1).nonzero().flatten().tolist()
            diff = (got.float() - want.float()).abs()[ne].max().item()
            what = "rows" if name == "hidden_out" else "layers"
            return (f"{name} {what} {rows[:8]}{' ...' if len(rows) > 8 else ''} ({len(rows)} of {ne.shape[0]}) "
                    f"differ, max |diff| {diff:.4g}")
    return None


def failed_on_any_rank(group, problem: str | None, device: torch.device) -> bool:
    """Whether any rank of ``group`` found a ``problem`` (one all-reduce): every rank then
    raises, so none is left waiting in a collective."""
    failed = torch.tensor([problem is not None], dtype=torch.int64, device=device)
    group.all_reduce_(failed, "max")
    return bool(failed.item())
