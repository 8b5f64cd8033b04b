"""Is a training process progressing, stalled, or slow? Pure logic over observed progress, with
an injectable clock, so every rule is testable without waiting.

Progress is any forward movement: a new step, or a phase counter that moved, or a new phase. The
stall timeout is learned from the job's own history: `factor` x the typical recent interval between
progress reports, clamped to [floor, ceiling]; the first step gets its own allowance (it may include
compilation or a cold cache); a phase that reports no counter gets a fixed budget.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class StallConfig:
    factor: float = 5.0
    floor_s: float = 30.0
    ceiling_s: float = 1800.0
    first_step_s: float = 600.0
    phase_s: float = 900.0
    warmup_intervals: int = 5

    def merged(self, overrides: dict) -> "StallConfig":
        return StallConfig(**{**self.__dict__, **{k: v for k, v in overrides.items() if v is not None}})


@dataclass
class Verdict:
    kind: str  # "stalled" or "progressing"
    silent_s: float
    timeout_s: float
    phase: Optional[str]
    message: str


@dataclass
class StallDetector:
    config: StallConfig = field(default_factory=StallConfig)
    last_progress: Optional[float] = None
    phase: Optional[str] = None
    phase_done: Optional[float] = None
    has_counter: bool = False
    steps_seen: int = 0
    intervals: deque = field(default_factory=lambda: deque(maxlen=50))
    stalled: bool = False

    def start(self, now: float) -> None:
        self.last_progress = now

    def observe(self, kind: str, data: dict, now: float) -> None:
        """Feed every event from the training process (alive events are not progress)."""
        if kind == "phase":
            name, done = data.get("name"), data.get("done")
            if name != self.phase or (done is not None and done != self.phase_done):
                self._progress(now, same_phase=(name == self.phase))
            if name != self.phase:
                self.intervals.clear()
            self.phase, self.phase_done = name, done
            self.has_counter = done is not None
        elif kind == "metrics":
            self.steps_seen += 1
            self._progress(now, same_phase=True)

    def _progress(self, now: float, same_phase: bool) -> None:
        if self.last_progress is not None and same_phase:
            self.intervals.append(now - self.last_progress)
        self.last_progress = now
        self.stalled = False

    def timeout(self) -> float:
        c = self.config
        if self.phase == "training" and self.steps_seen == 0 and len(self.intervals) < 1:
            return max(c.first_step_s, c.floor_s)
        if len(self.intervals) >= min(c.warmup_intervals, 2):
            typical = statistics.median(self.intervals)
            worst = max(self.intervals)
            return min(c.ceiling_s, max(c.floor_s, c.factor * max(typical, worst / 2)))
        return max(c.floor_s, c.phase_s if not self.has_counter else c.first_step_s)

    def check(self, now: float) -> Optional[Verdict]:
        """A verdict when the job has just become stalled, or just recovered; else None."""
        if self.last_progress is None:
            return None
        silent = now - self.last_progress
        limit = self.timeout()
        if not self.stalled and silent > limit:
            self.stalled = True
            return Verdict("stalled", silent, limit, self.phase,
                           f"no progress in phase '{self.phase}' for {silent:.0f} s "
                           f"(timeout {limit:.0f} s, learned from this job's own pace)")
        return None
