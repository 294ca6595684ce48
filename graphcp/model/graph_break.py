"""The graph-break marker.

A function decorated with :func:`graph_break` runs eagerly between two captured
graph segments. Its first argument is the :class:`ForwardContext`; its tensor
arguments are read and written in place (it returns nothing), so a replay can
call it again on the tensors capture recorded. When the context has no break
handler (an eager forward) the function just runs.

This module is tiny on purpose: the model marks breaks, the capture machinery
installs handlers, and neither imports the other.
"""

from __future__ import annotations

import functools
from typing import Callable, Protocol


class BreakHandler(Protocol):
    def __call__(self, name: str, fn: Callable, ctx, args: tuple) -> None: ...


def graph_break(name: str) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(ctx, *args) -> None:
            handler = ctx.break_handler
            if handler is None:
                fn(ctx, *args)
            else:
                handler(name, fn, ctx, args)

        wrapper.graph_break_name = name  # type: ignore[attr-defined]
        wrapper.__wrapped_break__ = fn  # type: ignore[attr-defined]
        return wrapper

    return deco
