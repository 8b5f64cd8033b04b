"""The 'quiet' warning of a command job: a finished phase (or a phase without a counter) and nothing
reported since for quiet_s. The agent then looks where the main thread waits (a stack it takes
itself) and warns, distinct from a stall; while the warning is open the job's phase line says so
(refreshed each minute), and the process's own phase comes back once it moves.

Split from the first-steps verdicts (advice.py): those judge what the job reports; this judges its
silence."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from worker.agent.headline import waits_in


@dataclass
class QuietWatch:
    quiet_s: float = 60.0
    last_output: Optional[str] = None
    phase: Optional[dict] = None  # the process's latest phase event: the job's line again once it moves
    open: bool = False
    checked_at: Optional[float] = None  # the last progress time a quiet verdict was judged for
    since: Optional[tuple[str, float]] = None  # (what finished or began, when): the quiet phase line's facts
    line_at: float = 0.0  # when the quiet phase line was last sent

    def output(self, line: str) -> None:
        if line.strip():
            self.last_output = line.strip()[:300]

    def due(self, detector, now: float) -> Optional[str]:
        """The headline of a 'quiet' warning once nothing was reported for quiet_s after a phase
        finished (or in a phase without a counter); the agent then looks where the main thread is."""
        if self.open or detector.last_progress is None or detector.stalled:
            return None
        if detector.has_counter and not detector.finished():
            return None  # a counted phase in flight: the stall detector judges it by its own pace
        silent = now - detector.last_progress
        if silent < self.quiet_s or self.checked_at == detector.last_progress:
            return None
        self.checked_at = detector.last_progress
        what = f"'{detector.phase}' finished" if detector.finished() else f"'{detector.phase}' began"
        self.since = (what, detector.last_progress)
        return self._head(now, self.since)

    def _head(self, now: float, quiet_since: tuple[str, float]) -> str:
        what, since = quiet_since
        msg = f"no progress reported since {what} {_ago(now - since)} ago"
        if self.last_output:
            msg += f"; last output: {self.last_output}"
        return msg

    def phase_line(self, now: float) -> Optional[dict]:
        """While the quiet warning is open, the job's own phase line (the jobs list, the job page) says
        so, its age refreshed each minute, instead of the finished phase. `quiet` marks it as the
        agent's line, not progress."""
        if not self.open or self.since is None or now - self.line_at < 60:
            return None
        self.line_at = now
        return {"name": self._head(now, self.since)[:500], "quiet": True}

    def message(self, head: str, stack: Optional[str]) -> str:
        self.open = True
        where = waits_in(stack)
        msg = head + (f"; {where}" if where else "")
        return (msg + ". Not a hang alert: the process is alive and the stall detector still watches it\nFix: "
                "report progress (print every N items, wrap the loop or the stream in tqdm, or "
                "tokenpulse.log(step, ...)) so the job shows what it does")

    def over(self) -> bool:
        """Progress again: the quiet warning clears (True once)."""
        if self.open:
            self.open, self.line_at = False, 0.0
            return True
        return False


def _ago(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"
