"""Progress bars: the one place graphcp makes them (capture's buckets, decode's steps).

They are drawn only where stderr is a terminal (:func:`graphcp.errors.stderr_is_terminal`):
a bar redraws its line with carriage returns, noise in a log or a pipe, where a
command's stderr holds notes and errors, a line each (docs/cli.md).
"""

from __future__ import annotations

import sys
from typing import Any

from graphcp.errors import stderr_is_terminal


def progress_bar(show: bool, items: Any = None, **kw: Any):
    """A tqdm bar on stderr (over ``items`` when given; ``kw``: tqdm's, such as ``total``,
    ``desc``, ``unit``) when ``show`` and stderr is a terminal; None otherwise, or
    without tqdm installed."""
    if not (show and stderr_is_terminal()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(items, file=sys.stderr, **kw)
