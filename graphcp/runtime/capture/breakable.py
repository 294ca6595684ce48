"""Breakable graphs: a body captured as segments separated by breaks.

While a body runs under :func:`capture_breakable`, the context's break handler
closes the current segment at every :func:`graphcp.model.graph_break.graph_break`
call, records the break (its function and the tensors it was given), runs it
eagerly, and opens the next segment. Replay runs segment 0, break 0, segment 1,
..., calling each break with the *live* forward context and the recorded tensors,
so it reads the live batch's metadata and writes the tensor capture recorded as
its output. A replay moves what the segments' collectives moved at capture without
running Python, and the breaks count their own as they run again: so the capture
keeps what its breaks counted apart (:attr:`BreakableGraph.break_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from graphcp.nvtx_ranges import nvtx_range
from graphcp.runtime.capture.graphs import GraphBackend, GraphSegment


@dataclass
class RecordedBreak:
    name: str
    fn: Callable
    args: tuple
    label: str  # e.g. "attention[3]"


@dataclass
class BreakableGraph:
    segments: list[GraphSegment] = field(default_factory=list)
    breaks: list[RecordedBreak] = field(default_factory=list)
    capacity: int = 0
    #: what the breaks added to the context's numeric stats while the graph was captured
    break_stats: dict[str, int] = field(default_factory=dict)

    def replay(self, ctx) -> None:
        for i, seg in enumerate(self.segments):
            with nvtx_range(f"segment[{i}]", category="segment"):
                seg.replay()
            if i < len(self.breaks):
                b = self.breaks[i]
                b.fn(ctx, *b.args)

    @property
    def ops_per_segment(self) -> list[int | None]:
        return [s.num_ops for s in self.segments]


def capture_breakable(backend: GraphBackend, ctx, body: Callable[[], Any],
                      breakable: bool | Callable[[str], bool] = True) -> BreakableGraph:
    """Run ``body()`` once under capture. ``breakable=False`` keeps every break
    inside the graph (full-graph mode: the break functions are captured too); a
    predicate on a break's name keeps the breaks it is true for (a decode graph breaks
    only where a layer sizes work on the host) and captures the others."""
    graph = BreakableGraph()
    current: list[GraphSegment] = []
    keep = breakable if callable(breakable) else None

    def open_segment() -> None:
        seg = backend.new_segment()
        seg.begin()
        current.append(seg)

    def on_break(name: str, fn: Callable, bctx, args: tuple) -> None:
        if keep is not None and not keep(name):  # captured inside the segment
            fn(bctx, *args)
            return
        seg = current.pop()
        seg.end()
        graph.segments.append(seg)
        layer = args[0] if args and isinstance(args[0], int) else len(graph.breaks)
        graph.breaks.append(RecordedBreak(name, fn, args, f"{name}[{layer}]"))
        stats = getattr(bctx, "stats", None)
        before = dict(stats) if stats else {}
        fn(bctx, *args)
        for key, value in (stats or {}).items():
            if isinstance(value, int) and value != before.get(key, 0):
                graph.break_stats[key] = graph.break_stats.get(key, 0) + value - before.get(key, 0)
        open_segment()

    prev = ctx.break_handler
    ctx.break_handler = on_break if breakable else None
    try:
        open_segment()
        body()
        seg = current.pop()
        seg.end()
        graph.segments.append(seg)
    finally:
        for seg in current:  # an exception mid-segment: stop recording
            try:
                seg.end()
            except Exception:  # noqa: BLE001
                pass
        ctx.break_handler = prev
    return graph
