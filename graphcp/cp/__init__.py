"""Context-parallel layouts: which rank owns which new tokens of a batch.

``make_layout("zigzag", cp_size).plan(extend_lens, prefix_lens)`` returns a
:class:`Plan`, the same on every rank; ``plan.rank(r)`` is what rank ``r`` needs
(its rows in local order and its attention segments), and
``plan.gather_index(capacity)`` restores global order after a rank-major
all-gather. Pure host code (numpy).
"""

from __future__ import annotations

from graphcp.cp.base import Layout, Plan, RankPlan, causal_work_per_rank
from graphcp.cp.interleave import InterleaveLayout, InterleavePlan
from graphcp.cp.zigzag import ZigzagLayout, ZigzagPlan

__all__ = [
    "LAYOUTS",
    "InterleaveLayout",
    "InterleavePlan",
    "Layout",
    "Plan",
    "RankPlan",
    "ZigzagLayout",
    "ZigzagPlan",
    "causal_work_per_rank",
    "make_layout",
]

#: layout name -> class
LAYOUTS: dict[str, type[Layout]] = {
    ZigzagLayout.name: ZigzagLayout,
    InterleaveLayout.name: InterleaveLayout,
}


def make_layout(name: str, cp_size: int) -> Layout:
    """The layout called ``name`` ("zigzag" or "interleave") for ``cp_size`` ranks."""
    try:
        cls = LAYOUTS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown CP layout {name!r}; expected one of {sorted(LAYOUTS)}"
        ) from None
    return cls(cp_size)
