"""The wall-clock budget of one GPU-check run, shared out between its parts."""

from __future__ import annotations

import time


class Budget:
    """Wall-clock budget: a total, and a share per part (``settings.PHASES``). A part
    may use its share plus whatever earlier parts left; nothing starts past the
    total minus ``reserve_s`` (kept for the report)."""

    def __init__(self, total_s: float, phases: dict[str, float], reserve_s: float) -> None:
        self.total_s, self.reserve_s = total_s, reserve_s
        self.phases = dict(phases)
        self.t0 = time.perf_counter()
        self.used: dict[str, float] = {}
        self._phase: str | None = None
        self._phase_end = self.t0 + total_s
        self._phase_t0 = self.t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def start(self, phase: str) -> None:
        self.stop()
        now = time.perf_counter()
        earlier = sum(s for name, s in self.phases.items() if name in self.used)
        carry = max(0.0, earlier - (now - self.t0))
        self._phase, self._phase_t0 = phase, now
        self._phase_end = now + self.phases.get(phase, 0.0) + carry

    def stop(self) -> None:
        if self._phase is not None:
            self.used[self._phase] = round(time.perf_counter() - self._phase_t0, 2)
            self._phase = None

    def remaining(self) -> float:
        now = time.perf_counter()
        total_left = self.total_s - self.reserve_s - (now - self.t0)
        return min(total_left, self._phase_end - now)

    def allows(self, need_s: float) -> bool:
        return self.remaining() >= need_s
