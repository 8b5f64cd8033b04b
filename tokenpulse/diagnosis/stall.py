"""Is a training process progressing or stalled? Pure logic over observed events, with the clock
passed in (`now`), so every rule is testable without waiting.

Alive is not progress: the training process's `alive` thread speaks every second whatever its main
thread does. Progress is forward movement only: a new optimizer step (metrics, or the step an
`alive` carries), a phase counter that moved forward (tokenizing 1200/5000) or restarted (a new
bar), a counter-less phase whose detail changed (accumulating 234 samples), or a switch to another
phase. Nothing else restarts the clock or an allowance: a phase event repeating its counter (a
redrawn bar), the same counter under another name (a bar redrawn by another thread than the one
that reports it), a step not above the highest seen, and phase switches back and forth with
nothing moving in between (each phase's entry counts once until something moves again).

A job with no progress signal at all (no step, no counter: a shell script, a data-prep script) is
judged on its output: each new output line is movement, and the timeout is learned from the
intervals between lines exactly as from steps. Every stalled verdict names the signal it judged by.

The stall timeout is learned from the job's own history, per phase: `factor` x the typical recent
interval between progress reports in that phase (the median, or half the worst recent interval if
that is larger: a job with a regular slow step is not stalled by it), clamped to [floor, ceiling].
A phase without enough history gets an allowance instead: `first_step_s` for a counted phase (its
first unit may include compilation or a cold cache), `phase_s` for a phase that reports no counter.

Every threshold has a default here, an agent-wide override in the environment (TOKENPULSE_STALL_<NAME>,
e.g. TOKENPULSE_STALL_FLOOR_S=60) and a per-job override in spec.stall (StallSpec).
"""
from __future__ import annotations

import os
import statistics
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Optional

from tokenpulse.protocol import AlertKind


@dataclass
class StallConfig:
    # ---- stalled ----
    factor: float = 10.0  # stalled after factor x the typical interval between progress reports
    floor_s: float = 30.0  # never stalled before this many silent seconds
    ceiling_s: float = 1800.0  # always stalled after this many silent seconds
    first_step_s: float = 600.0  # allowance before a counted phase (training included) has history
    phase_s: float = 900.0  # budget for a phase that reports no counter
    min_intervals: int = 3  # intervals needed before the learned timeout applies
    # ---- slow (worker/slow.py) ----
    slow_factor: float = 4.0  # throughput this many times below the job's own earlier rate
    slow_projection_factor: float = 5.0  # ... or this many times below the preflight projection
    slow_growth_factor: float = 2.0  # step time grew steadily by this factor
    slow_padding_frac: float = 0.5  # more than this fraction of batch tokens are padding
    slow_step_s: float = 120.0  # an optimizer step slower than this crawls (batch too large)
    slow_periodic_frac: float = 0.25  # periodic pauses costing this fraction of the time
    slow_min_samples: int = 3  # speed samples (metrics with step_time_s) before judging slowness
    slow_input_frac: float = 0.3  # input-bound: this share of each step waits for the next batch
    quiet_s: float = 60.0  # a finished phase and nothing since for this long: a 'quiet' warning (advice.py)
    # ---- alert hysteresis (worker/agent/hysteresis.py): slow reasons, contention, stragglers ----
    alert_open_s: float = 10.0  # a condition must hold this long before its alert opens
    alert_clear_s: float = 30.0  # ... and stay away this long before it clears (a stall: keep moving)
    # ---- a stall that lasts: the agent ends the attempt as a hang (worker/agent/job_diagnosis.py) ----
    kill_after_s: float = -1.0  # after the stall alert opened; -1: the job kind's default, 0: never

    def merged(self, overrides: dict) -> "StallConfig":
        known = {f.name for f in fields(self)}
        return StallConfig(**{**self.__dict__,
                              **{k: v for k, v in overrides.items() if v is not None and k in known}})

    @classmethod
    def from_env(cls, env=None) -> "StallConfig":
        """Agent-wide defaults from TOKENPULSE_STALL_<FIELD> (e.g. TOKENPULSE_STALL_FACTOR=8)."""
        env = os.environ if env is None else env
        c = cls()
        for f in fields(c):
            raw = env.get(f"TOKENPULSE_STALL_{f.name.upper()}")
            if raw is None or raw == "":
                continue
            try:
                setattr(c, f.name, type(getattr(c, f.name))(float(raw)))
            except ValueError:
                raise ValueError(f"TOKENPULSE_STALL_{f.name.upper()}={raw!r}: not a number") from None
        return c


@dataclass
class Verdict:
    kind: str  # "stalled", "recovered" (for stalls); "slow", "slow_clear" (worker/slow.py)
    message: str
    silent_s: float = 0.0
    timeout_s: float = 0.0
    phase: Optional[str] = None
    reasons: list = field(default_factory=list)


def _describe_phase(phase: Optional[str], done, total, unit) -> str:
    if phase is None:
        return "starting (before the first progress report)"
    s = f"'{phase}'"
    if done is not None:
        s += f" at {done:g}" + (f"/{total:g}" if total else "") + (f" {unit}" if unit else "")
    return s


@dataclass
class StallDetector:
    config: StallConfig = field(default_factory=StallConfig)
    last_progress: Optional[float] = None
    last_event: Optional[float] = None  # any line from the process (alive included)
    phase: Optional[str] = None
    done: Optional[float] = None
    total: Optional[float] = None
    unit: Optional[str] = None
    detail: Optional[str] = None
    step: Optional[int] = None
    has_counter: bool = False
    moved: int = 0  # forward movements since entering the current phase
    intervals: dict = field(default_factory=dict)  # phase -> deque of seconds between progress
    stalled: bool = False
    stalled_at: Optional[float] = None
    events: int = 0  # lines seen from the process (its signal handlers exist once it speaks)
    counted: bool = False  # a phase counter or a step was ever seen: output lines are then not progress
    output_lines: int = 0  # output lines seen (the signal of a job that reports no progress)
    entered: set = field(default_factory=set)  # phases whose entry counted since something last moved
    units: dict = field(default_factory=dict)  # phase -> units of movement its history was learned from
    step_phase: Optional[str] = None  # the phase whose history holds the job's step interval
    stopped_since: Optional[float] = None  # the process has been stopped (SIGSTOP, job control) since

    def start(self, now: float) -> None:
        self.last_progress = self.last_event = now

    def observe_stopped(self, stopped: bool, now: float) -> None:
        """The agent read the process's state: stopped (T) or not. A stopped process moves no more
        whatever its phase promised, so its timeout is the floor: no interval has to be learned
        first (a fast loop stopped in its first seconds otherwise waits out the first-step budget)."""
        if not stopped:
            self.stopped_since = None
        elif self.stopped_since is None:
            self.stopped_since = now

    # ---- feeding -----------------------------------------------------------------------------

    def observe(self, kind: str, data: dict, now: float) -> Optional[Verdict]:
        """Feed every event from the training process. Returns a 'recovered' verdict when a
        stalled job moves again."""
        self.last_event = now
        self.events += 1
        if kind == "phase":
            name, done, detail = data.get("name"), data.get("done"), data.get("detail")
            unit, total = data.get("unit"), data.get("total")
            if done is not None:
                self.counted = True
            if name != self.phase:
                if done is not None and self.done is not None and done == self.done and total == self.total:
                    return None  # the same counter under another name: a redraw, not a new phase
                self.phase, self.moved = name, 0
                self.done, self.detail, self.unit, self.total = done, detail, unit, total
                self.has_counter = done is not None
                if unit == "steps" and done is not None:
                    if self.step is None or int(done) > self.step:
                        self.step = int(done)
                        # a step reported at entry ends that step: the steps after it are steady work
                        self.moved = 1 if done >= 1 else 0
                        return self._progress(now, interval=False, moved=True)
                    if done >= 1:  # its step came a moment before (alive raced the phase): setup is over too
                        self.moved = 1
                if name in self.entered:
                    return None  # back and forth with nothing moving: not movement
                self.entered.add(name)
                return self._progress(now, interval=False, moved=False)
            self.unit, self.total = unit, total
            if done is not None:
                self.has_counter = True
                if unit == "steps" and self.step is not None and done <= self.step:
                    self.done = done  # the metrics of this step already counted as progress
                    return None
                if self.done is not None and done < self.done and unit != "steps":
                    self.done, self.detail, self.moved = done, detail, 0  # a new bar of the same name
                    return self._progress(now, interval=False)
                if self.done is None or done > self.done:
                    units = 1.0
                    if unit == "steps":
                        units = max(1, int(done) - (self.step if self.step is not None else int(done) - 1))
                        self.step = int(done)
                    self.done, self.detail = done, detail
                    return self._progress(now, interval=True, units=units, steps=unit == "steps")
                return None
            if detail != self.detail and not self.has_counter:
                self.detail = detail
                return self._progress(now, interval=True)
            return None
        if kind == "metrics" or (kind == "alive" and data.get("step") is not None):
            step = int(data.get("step", 0))
            if self.step is None or step > self.step:
                units = step - self.step if self.step is not None else 1
                self.step = step
                self.counted = True
                if self.unit == "steps":
                    self.done = step
                return self._progress(now, interval=True, units=units, steps=True)
        return None

    def observe_output(self, now: float) -> Optional[Verdict]:
        """A new output line of the job. Movement only for a job with no other progress signal."""
        self.output_lines += 1
        if self.counted:
            return None
        last, self.last_progress = self.last_progress, now
        if self.output_lines > 1 and last is not None:  # the first line may follow setup: not typical
            self.intervals.setdefault(OUTPUT, deque(maxlen=50)).append(now - last)
        self.entered.clear()
        if self.stalled:  # stalled: it had progress before (check() needs some), so last is set
            self.stalled, self.stalled_at = False, None
            silent = now - last if last is not None else 0.0
            return Verdict("recovered", f"progressing again: output after {silent:.0f} s without any",
                           silent_s=silent, phase=self.phase)
        return None

    def signal(self) -> str:
        """What the detector judges this job by, in words for the alert."""
        if self.step is not None:
            return "training steps"
        if self.counted:
            return "progress counters"
        if self.output_lines:
            return "its output lines (it reports no steps or counters)"
        return "its phases (no steps, counters or output yet)"

    def _history(self):
        return self.intervals.get(OUTPUT if self.by_output() else self.phase)

    def _learned(self, phase) -> bool:
        """Enough movement seen in `phase` to judge it by its own typical interval."""
        hist = self.intervals.get(phase)
        return hist is not None and len(hist) > 0 and self.units.get(phase, len(hist)) >= self.config.min_intervals

    def _typical(self, phase) -> float:
        recent = list(self.intervals[phase])[-20:]
        return max(statistics.median(recent), max(recent) / 2)

    def _fallback(self) -> Optional[str]:
        """The phase whose history judges a phase that has none of its own yet: once the job's step
        interval is learned, an evaluation or a checkpoint save is judged by it (a first-step
        allowance of minutes there would hide an evaluation that never ends)."""
        if self.by_output() or self.step_phase is None or self.step_phase == self.phase:
            return None
        return self.step_phase if self._learned(self.step_phase) else None

    def by_output(self) -> bool:
        return not self.counted and self.output_lines > 0

    def _progress(self, now: float, interval: bool, moved: bool = True, units: float = 1.0,
                  steps: bool = False) -> Optional[Verdict]:
        """Movement. `units`: steps (or counts) this report moved by. The training process reports its
        step at most once a second (alive, a rate-limited phase), so one report may cover many steps:
        the history keeps seconds per unit, and counts units, not reports, towards min_intervals."""
        if moved:
            self.entered.clear()  # something moved: a later phase switch counts again
        if interval and self.last_progress is not None:
            if self.moved > 0:  # the first movement in a phase may include setup: not typical
                units = max(1.0, float(units))
                self.intervals.setdefault(self.phase, deque(maxlen=50)).append((now - self.last_progress) / units)
                self.units[self.phase] = self.units.get(self.phase, 0) + units
                if steps:
                    self.step_phase = self.phase
            self.moved += 1
        silent = now - self.last_progress if self.last_progress is not None else 0.0
        self.last_progress = now
        if self.stalled:
            self.stalled, self.stalled_at = False, None
            return Verdict("recovered", f"progressing again: {self.where()} after {silent:.0f} s without "
                           f"progress", silent_s=silent, phase=self.phase)
        return None

    # ---- judging -----------------------------------------------------------------------------

    def where(self) -> str:
        return _describe_phase(self.phase, self.done, self.total, self.unit)

    def phase_line(self) -> Optional[dict]:
        """The phase as the detector last saw it, its count included, as a phase event's data. The
        process reports its step on `alive` each second, ahead of its rate-limited phase line and its
        metrics every log_every steps: said as a phase when a stall opens, the job's Step, its phase
        line and the stall alert name the same step (None: no phase seen yet)."""
        if self.phase is None:
            return None
        return {"name": self.phase, "done": self.done, "total": self.total, "unit": self.unit, "detail": self.detail}

    def timeout(self) -> float:
        """Seconds without progress after which the current phase counts as stalled."""
        c = self.config
        key = OUTPUT if self.by_output() else self.phase
        if self.stopped_since is not None:
            limit = c.floor_s  # stopped: it cannot move until someone continues it
        elif self.finished():
            limit = c.phase_s  # the counter is complete: the process is between phases
        elif self._learned(key):
            limit = c.factor * self._typical(key)
        elif self._fallback() is not None:
            limit = c.factor * self._typical(self._fallback())
        else:
            limit = c.first_step_s if self.has_counter else c.phase_s
        return max(c.floor_s, min(c.ceiling_s, limit))

    def finished(self) -> bool:
        done, total = self.done, self.total
        return self.has_counter and total is not None and total != 0 and done is not None and done >= total

    def explain_timeout(self) -> str:
        c = self.config
        key = OUTPUT if self.by_output() else self.phase
        if self.stopped_since is not None:
            return f"the process is stopped (SIGSTOP or job control): the floor of {c.floor_s:g} s"
        if self.by_output() and self._learned(key):
            return (f"{c.factor:g} x the typical interval of {self._typical(key):.2f} s between its "
                    f"output lines, within [{c.floor_s:g}, {c.ceiling_s:g}] s")
        if self.finished():
            return f"budget between phases (after {self.where()}), within [{c.floor_s:g}, {c.ceiling_s:g}] s"
        per = "step" if key == self.step_phase else "unit"
        if self._learned(key):
            return (f"{c.factor:g} x this phase's typical {self._typical(key):.2f} s per {per} (learned from "
                    f"{self.units.get(key, 0):g} {per}s), within [{c.floor_s:g}, {c.ceiling_s:g}] s")
        if self._fallback() is not None:
            return (f"{c.factor:g} x the job's typical {self._typical(self._fallback()):.2f} s per step "
                    f"(this phase has no history yet), within [{c.floor_s:g}, {c.ceiling_s:g}] s")
        what = "first-step allowance" if self.has_counter else "budget for a phase without a counter"
        return f"{what}, within [{c.floor_s:g}, {c.ceiling_s:g}] s"

    def check(self, now: float) -> Optional[Verdict]:
        """A 'stalled' verdict when the job has just become stalled; else None."""
        if self.last_progress is None or self.stalled:
            return None
        silent = now - self.last_progress
        limit = self.timeout()
        if silent <= limit:
            return None
        self.stalled, self.stalled_at = True, now
        quiet = now - (self.last_event or self.last_progress)
        if quiet > 5:
            alive = (f"; the process has also said nothing for {quiet:.0f} s (its alive thread is silent: "
                     f"frozen, a deadlock holding the GIL, SIGSTOP, or uninterruptible I/O)")
        else:
            alive = ALIVE_CLAUSE
        return Verdict(AlertKind.STALLED, f"stalled: no progress in {self.where()} for {silent:.0f} s (timeout "
                       f"{limit:.0f} s: {self.explain_timeout()}; judged by {self.signal()}){alive}",
                       silent_s=silent, timeout_s=limit, phase=self.phase)


OUTPUT = "(output)"  # the intervals between output lines, kept beside the phases
ALIVE_CLAUSE = "; the process is alive (its alive thread still reports) but its work does not move"


def stuck_at(stack: Optional[str]) -> Optional[str]:
    """The main thread's innermost frame from a py-spy or faulthandler dump: where it is stuck."""
    if not stack:
        return None
    lines = stack.splitlines()
    for i, line in enumerate(lines):
        if ('"MainThread"' in line and line.startswith("Thread ")) or line.startswith("Current thread "):
            for nxt in lines[i + 1:i + 3]:
                nxt = nxt.strip()
                if nxt.startswith("File "):  # faulthandler: File "path", line N in func
                    try:
                        path = nxt.split('"')[1]
                        rest = nxt.split('"', 2)[2]
                        lineno = rest.split("line ")[1].split()[0]
                        func = rest.split(" in ", 1)[1]
                        return f"{func} ({path}:{lineno})"
                    except IndexError:
                        return nxt
                if nxt:
                    return nxt  # py-spy: func (path:line)
    # py-spy names threads only once the threading module is loaded; the main thread's id is the pid
    pid = next((x.split()[1].rstrip(":") for x in lines if x.startswith("Process ")), None)
    for i, line in enumerate(lines):
        if pid and line.startswith(f"Thread {pid} ") and i + 1 < len(lines) and lines[i + 1].strip():
            return lines[i + 1].strip()
    return None
