"""The wall-clock budget of one GPU-check run, shared out between its parts."""

from __future__ import annotations

import time
from typing import Callable


class Budget:
    """Wall-clock budget: a total, and a share of it per part (``settings.PHASES``, scaled
    so that the shares fill the total less ``reserve_s``, which is kept for the report). A
    part may use its share plus whatever earlier parts left; nothing starts past the total
    minus the reserve. ``clock``: seconds, monotonic (the tests pass a fake one: no test may
    depend on the machine's speed or load)."""

    def __init__(self, total_s: float, phases: dict[str, float], reserve_s: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.total_s, self.reserve_s = total_s, reserve_s
        weight = sum(phases.values())
        scale = max(0.0, total_s - reserve_s) / weight if weight > 0 else 0.0
        self.phases = {name: share * scale for name, share in phases.items()}
        self.clock = clock
        self.t0 = clock()
        self.used: dict[str, float] = {}
        self._phase: str | None = None
        self._phase_end = self.t0 + total_s
        self._phase_t0 = self.t0

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def start(self, phase: str) -> None:
        self.stop()
        now = self.clock()
        earlier = sum(s for name, s in self.phases.items() if name in self.used)
        carry = max(0.0, earlier - (now - self.t0))
        self._phase, self._phase_t0 = phase, now
        self._phase_end = now + self.phases.get(phase, 0.0) + carry

    def stop(self) -> None:
        if self._phase is not None:
            self.used[self._phase] = round(self.clock() - self._phase_t0, 2)
            self._phase = None

    def remaining(self) -> float:
        now = self.clock()
        total_left = self.total_s - self.reserve_s - (now - self.t0)
        return min(total_left, self._phase_end - now)

    def allows(self, need_s: float) -> bool:
        return self.remaining() >= need_s
