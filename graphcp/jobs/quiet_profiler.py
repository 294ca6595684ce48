"""PyTorch's profiler (Kineto) writes ``STAGE:`` and ``USDT: ... profiler_start`` lines
to stderr from C++ on every start and stop, whatever its log level; ``graphcp profile``
and ``graphcp gpu-check`` run it on every rank, so they hide those lines (and only
those)."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

#: Kineto's progress log: ``STAGE:2026-12-01 13:59:34 31924:31924 File.cpp:51] Completed Stage: ...``
KINETO_LINE = re.compile(r"(?:STAGE|USDT):\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ \S+:\d+\] ")


@contextmanager
def without_kineto_log() -> Iterator[None]:
    """Run the block with stderr (file descriptor 2) going to a temporary file, then
    pass on every line of it but Kineto's progress log (delayed, not lost)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [x for x in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not KINETO_LINE.match(x)]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()
