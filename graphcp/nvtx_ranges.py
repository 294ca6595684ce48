"""NVTX ranges that also feed ``torch.profiler``, so an ``nsys`` timeline and a
CPU Chrome trace carry the same names.

One helper, :func:`nvtx_range`, marks everything: NVTX domain ``graphcp``, one
NVTX category per kind of range, and while a torch profiler records, a
``graphcp:<name>`` event (``nsys`` shows the domain the same way, so both
tools read ``graphcp:replay[256]``). :data:`RANGES` is the naming scheme;
profiles/README.md explains how to read it.

Cost with no profiler attached (the serving case): a dict lookup and two flag
tests on top of the ``with`` statement itself, ~0.3 us a range in all
(``benchmarks/bench_profiling.py``). The ``nvtx`` package hands out a no-op
domain when no tool is attached; we check that once at import instead of
calling into it on every range.

The ``nvtx`` package is optional: without it (a GPU image that lacks it, say)
graphcp imports and runs the same, the ranges feed ``torch.profiler`` only, and
:data:`NVTX_AVAILABLE` is False (nsys then sees no graphcp ranges).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.autograd.profiler as _torch_prof

try:
    import nvtx
except ImportError:  # optional: without it ranges still reach torch.profiler
    nvtx = None

#: whether the ``nvtx`` package imported (NVTX ranges for nsys need it)
NVTX_AVAILABLE = nvtx is not None

DOMAIN = "graphcp"
PREFIX = f"{DOMAIN}:"  # torch.profiler event names, and how nsys shows a domain's ranges


@dataclass(frozen=True)
class RangeKind:
    category: str
    meaning: str


#: the naming scheme: family -> kind. A name is the family, or ``family[<index>]``.
RANGES: dict[str, RangeKind] = {
    "prefill": RangeKind("forward", "one PrefillEngine.prefill call, validation to logits: the forward"),
    "plan": RangeKind("host", "validate the batch, SPMD fingerprint check, layout plan"),
    "prepare": RangeKind("host", "this rank's rows, token ids, KV slots and attention metadata"),
    "select": RangeKind("host", "bucket selection (graph modes)"),
    "fill": RangeKind("host", "copy the live batch into the static buffers, check them against capture"),
    "replay": RangeKind("graph", "replay[<capacity>]: one replay of a bucket's body (segments and breaks)"),
    "segment": RangeKind("segment", "segment[<i>]: captured graph segment i, the work that leads into attention[i]"),
    "attention": RangeKind("break", "attention[<layer>]: attention of one layer (the eager break in a replay)"),
    "kv_slots_gather": RangeKind("comm", "all-gather of every rank's KV slot mapping, once per forward "
                                 "(eager and capture only)"),
    "kv_exchange": RangeKind("comm", "kv_exchange[<layer>]: K/V all-gather + cache write (eager and capture only)"),
    "moe": RangeKind("break", "moe[<layer>]: routing, all-to-all dispatch, local experts and combine of an "
                     "expert-parallel MoE layer (in its attention+moe break, after attention[<layer>])"),
    "moe_dispatch": RangeKind("comm", "the expert-parallel all-to-all that sends each routed row to its expert's rank"),
    "moe_combine": RangeKind("comm", "the all-to-all that brings the expert outputs back to the token's rank"),
    "eager_body": RangeKind("eager", "the body run eagerly (graph off, or a graph-mode fallback)"),
    "layer": RangeKind("eager", "layer[<i>]: one decoder layer run eagerly"),
    "capture": RangeKind("capture", "capture[<capacity>]: warm-up and capture of one bucket"),
    "lm_head": RangeKind("output", "gather the last-token rows across ranks, LM head"),
    "measure": RangeKind("profile", "the measured window of `graphcp profile` (not in the library)"),
}
CATEGORIES = tuple(dict.fromkeys(k.category for k in RANGES.values()))
#: timeline colours per category (names the nvtx package knows without matplotlib)
COLORS = {"forward": "blue", "host": "yellow", "graph": "green", "segment": "darkgreen", "break": "red",
          "comm": "purple", "eager": "cyan", "capture": "orange", "output": "rapids", "profile": "white"}


def family(name: str) -> str:
    """``"attention[3]"`` -> ``"attention"``."""
    return name.split("[", 1)[0]


def index(name: str) -> int | None:
    """``"attention[3]"`` -> 3; ``None`` for a name without an index."""
    _, sep, rest = name.partition("[")
    return int(rest.rstrip("]")) if sep and rest.rstrip("]").isdigit() else None


# ---- NVTX: resolved once. nvtx returns a dummy domain when no tool is attached --------
_domain = nvtx.get_domain(DOMAIN) if nvtx is not None else None
_handle = getattr(_domain, "handle", None)  # None: no tool attached (or no nvtx), skip NVTX entirely
try:
    from nvtx._lib.lib import pop_range as _pop  # module-level: no kwargs parsing
    from nvtx._lib.lib import push_range as _push
except ImportError:  # older nvtx, or none (then _handle is None and these are never called)
    _push = lambda attrs, handle: _domain.push_range(attrs)  # noqa: E731
    _pop = lambda handle: _domain.pop_range()  # noqa: E731

# torch.profiler event: _RecordFunctionFast skips the dispatcher, so a graph being
# captured by the trace backend (a TorchDispatchMode) never records it as an op
try:
    from torch._C._profiler import _RecordFunctionFast as _record
except ImportError:  # pragma: no cover - older torch
    from torch.profiler import record_function as _record


class _Range:
    """One cached range object per name: entering it costs two flag tests when no
    profiler is attached. ``_open`` is a stack, so a name may nest in itself."""

    __slots__ = ("name", "category", "_attrs", "_label", "_open")

    def __init__(self, name: str, category: str) -> None:
        self.name, self.category = name, category
        self._label = PREFIX + name
        self._attrs = None
        if _handle is not None:
            self._attrs = _domain.get_event_attributes(message=name, color=COLORS.get(category), category=category)
        self._open: list = []

    def __enter__(self) -> "_Range":
        if _handle is not None:
            _push(self._attrs, _handle)
        # a plain module flag that torch.profiler sets on start: cheaper than asking C++
        if _torch_prof._is_profiler_enabled:
            rf = _record(self._label)
            rf.__enter__()
            self._open.append(rf)
        return self

    def __exit__(self, *exc) -> bool:
        if self._open:
            self._open.pop().__exit__(*exc)
        if _handle is not None:
            _pop(_handle)
        return False

    def __repr__(self) -> str:
        return f"nvtx_range({self.name!r}, category={self.category!r})"


_ranges: dict[str, _Range] = {}


def _new_range(name: str, category: str | None) -> _Range:
    kind = RANGES.get(family(name))
    if category is None:
        category = kind.category if kind is not None else "host"
    elif kind is not None and kind.category != category:
        raise ValueError(
            f"range {name!r} is category {kind.category!r} in graphcp.nvtx_ranges.RANGES, not {category!r}")
    r = _ranges[name] = _Range(name, category)
    return r


def nvtx_range(name: str, category: str | None = None) -> _Range:
    """``with nvtx_range("replay[256]", category="graph"):`` - one NVTX push/pop in
    domain ``graphcp`` (when a tool is attached) and a ``graphcp:<name>`` torch
    profiler event (while one records). ``category`` defaults to the one
    :data:`RANGES` gives the name's family; a name keeps one category."""
    r = _ranges.get(name)
    if r is None or (category is not None and category != r.category):
        return _new_range(name, category)
    return r


def _use_domain(domain) -> None:
    """Benchmarks and tests only: route ranges to ``domain`` (an ``nvtx`` Domain, or
    the dummy one to turn NVTX off) and forget the cached ranges."""
    global _domain, _handle
    _domain, _handle = domain, getattr(domain, "handle", None)
    _ranges.clear()
