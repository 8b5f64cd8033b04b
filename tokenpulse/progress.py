"""A steady time-remaining estimate for a terminal watching a job.

Step times on a shared machine jump around; a raw (total - done) / last_rate swings from seconds
to minutes within ten steps. The rate here is an exponential moving average over time (not over
samples), so a burst of quick polls cannot dominate, and it restarts when the phase changes or the
counter goes backwards (a resume, a new phase).
"""
from __future__ import annotations

import math
from typing import Optional


class RateEstimator:
    def __init__(self, half_life_s: float = 20.0):
        self.half_life_s = half_life_s
        self.rate: Optional[float] = None  # units per second
        self._last: Optional[tuple[str, float, float]] = None  # (phase, t, done)

    def update(self, phase: str, t: float, done: float) -> None:
        if self._last is None or self._last[0] != phase or done < self._last[2]:
            self._last, self.rate = (phase, t, done), None
            return
        _, t0, d0 = self._last
        dt = t - t0
        if dt <= 0 or done == d0:
            return  # no new information (a poll between two progress reports)
        inst = (done - d0) / dt
        w = 1 - math.exp(-dt * math.log(2) / self.half_life_s)  # weight by the time this sample covers
        self.rate = inst if self.rate is None else self.rate + w * (inst - self.rate)
        self._last = (phase, t, done)

    def eta_s(self, done: float, total: Optional[float]) -> Optional[float]:
        if not total or self.rate is None or self.rate <= 0:
            return None
        return max(0.0, (total - done) / self.rate)


def format_duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"
