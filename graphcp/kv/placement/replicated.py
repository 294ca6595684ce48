"""The replicated cache mode: every rank holds every token of every layer of every
request (what the all-gather exchange writes), so a rank's local index of a position is
the position and a prefix is read where it is. The base placement's answers are all of it."""

from __future__ import annotations

from graphcp.kv.placement.base import Placement


class ReplicatedPlacement(Placement):
    mode = "replicated"
    exchange = "all-gather"
