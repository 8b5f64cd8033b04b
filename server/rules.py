"""Alert rules people write, evaluated beside ingest (issue 22, item 2; issue 34).

A rule has a scope (all jobs, a job-name glob, one job), a condition (a metric above or below a
value, no improvement for N steps, a jump of K standard deviations, NaN or infinite, a job state),
a severity and webhook channels. A firing rule opens an alert of kind `rule:<id>` on its job through
ingest/alerts.py's upsert_alert, and clears it when the condition no longer holds: the same
open/update/clear life and the same webhook rules (open and clear only) as built-in alerts.

A rule acts on its owner's jobs only; a rule of an admin (or of no owner: from before owners) on
every job its scope names.

Never inside the single writer for metrics: ingest only notes a batch's (step, values) for the jobs
that have metric rules (apply.Outcome.rule_work); after the commit server/rule_runner.py judges them
on a thread of its own and writes the alerts that opened or cleared in a small write of their own
(Fired.deferred). State rules (a job's state, its stall, a NaN alert) are judged where the state
changes: rare, and a handful of rules per job.

The rules live in memory (reloaded after a change here, and every REFRESH_S for other server
processes); a job's applicable rules are computed once per job and rule set; only rules whose metric
is in the batch are looked at; the database is read once per (rule, job) to rebuild a rule's memory
(best value, recent values) from the stored series after a start. A jump rule keeps JUMP_WINDOW
values per job (Settings.rule_window_values).
"""
from __future__ import annotations

import fnmatch
import json
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from server.ingest.alerts import alert_dict, upsert_alert
from server.models import Alert, AlertRule
from tokenpulse.protocol import ALERTS_TOPIC, alert_frame

REFRESH_S = 5.0  # another server process's rule change is seen within this
JUMP_WINDOW = 50  # values a jump is measured against
JUMP_MIN = 10  # values needed before a jump can be judged
MAX_MEMORY = 100_000  # (rule, job) memories kept; the least recently made go first (rebuilt if needed)
NOW_SEP = "; now "
NOW_EVERY_S = 5.0  # an open rule alert's "now <value> at step <n>" is brought up to date at most this often
KIND_PREFIX = "rule:"
CONDITIONS = ("above", "below", "no_improvement", "jump", "nonfinite", "state")
STATES = ("failed", "completed", "cancelled", "stalled")
NON_FINITE_ALERT = "non_finite:"  # tokenpulse.log's alert for a NaN/inf value (JSON cannot carry one)


@dataclass
class Rule:
    id: int
    name: str
    owner_token_id: Optional[int]
    scope: str
    pattern: Optional[str]
    job_id: Optional[int]
    condition: str
    metric: Optional[str]
    threshold: Optional[float]
    steps: Optional[int]
    sigmas: Optional[float]
    mode: Optional[str]
    state: Optional[str]
    severity: str
    channels: list = field(default_factory=list)
    created_at: float = 0.0

    @classmethod
    def of(cls, r: AlertRule) -> "Rule":
        return cls(r.id, r.name, r.owner_token_id, r.scope, r.pattern, r.job_id, r.condition, r.metric,
                   r.threshold, r.steps, r.sigmas, r.mode, r.state, r.severity, json.loads(r.channels or "[]"),
                   r.created_at)

    def applies_to(self, job_id: int, name: Optional[str]) -> bool:
        if self.scope == "job":
            return self.job_id == job_id
        if self.scope == "name":
            return fnmatch.fnmatchcase(name or "", self.pattern or "")
        return True

    @property
    def kind(self) -> str:
        return f"{KIND_PREFIX}{self.id}"

    def out(self) -> dict:
        return {k: getattr(self, k) for k in ("id", "name", "owner_token_id", "scope", "pattern", "job_id",
                                               "condition", "metric", "threshold", "steps", "sigmas", "mode",
                                               "state", "severity", "channels", "created_at")}


class Rules:
    """The rule set of this server process and each (rule, job)'s memory."""

    def __init__(self):
        self.rules: dict[int, Rule] = {}
        self.loaded_at = -math.inf
        self.version = 0
        self.per_job: dict[int, tuple] = {}  # job id -> (version, name, {metric: [rules]}, [state rules])
        self.memory: dict[tuple[int, int], object] = {}  # (rule, job) -> best [value, step] or a Window
        self.open: set[tuple[int, int]] = set()  # (rule, job) with an alert not cleared
        self.admins: frozenset = frozenset()  # admin token ids: their rules act on every job
        self.now_at: dict[tuple[int, int], float] = {}  # (rule, job) -> when its open alert's "now" was written

    # ---- the rule set ----------------------------------------------------------------------------
    def changed(self) -> None:
        self.loaded_at = -math.inf

    def refresh(self, s: Session) -> None:
        now = time.monotonic()
        if now - self.loaded_at < REFRESH_S:
            return
        self.loaded_at = now
        rules = {r.id: Rule.of(r) for r in s.scalars(select(AlertRule))}
        admins = frozenset(i for (i,) in s.execute(text("SELECT id FROM tokens WHERE role = 'admin'")))
        if rules != self.rules or admins != self.admins:
            # replaced, never mutated: the rule thread and the writer both read them
            self.rules, self.admins, self.version = rules, admins, self.version + 1
            self.per_job = {}
            self.memory = {k: v for k, v in list(self.memory.items()) if k[0] in rules}
        self.open = {(int(kind[len(KIND_PREFIX):]), job_id) for job_id, kind in s.execute(text(
            "SELECT job_id, kind FROM alerts WHERE kind LIKE 'rule:%' AND state != 'cleared' AND job_id IS NOT NULL"))}

    def acts_on(self, r: Rule, owner: Optional[int]) -> bool:
        """A person's rule watches that person's jobs; an admin's (or an ownerless one's) every job."""
        return r.owner_token_id is None or r.owner_token_id in self.admins or r.owner_token_id == owner

    def for_job(self, job) -> tuple[dict, list]:
        hit = self.per_job.get(job.id)
        if hit is not None and hit[0] == self.version and hit[1] == (job.name, job.owner_token_id):
            return hit[2], hit[3]
        by_metric: dict[str, list[Rule]] = {}
        states: list[Rule] = []
        for r in list(self.rules.values()):
            if self.acts_on(r, job.owner_token_id) and r.applies_to(job.id, job.name):
                if r.condition == "state":
                    states.append(r)
                else:
                    by_metric.setdefault(r.metric, []).append(r)
        if len(self.per_job) > 10_000:
            self.per_job = {}
        self.per_job[job.id] = (self.version, (job.name, job.owner_token_id), by_metric, states)
        return by_metric, states

    def channels_for(self, alert: dict) -> list[dict]:
        kind = alert.get("kind") or ""
        if not kind.startswith(KIND_PREFIX):
            return []
        rule = self.rules.get(int(kind[len(KIND_PREFIX):]) if kind[len(KIND_PREFIX):].isdigit() else -1)
        return rule.channels if rule is not None else []

    # ---- evaluation ----------------------------------------------------------------------------
    def on_metrics(self, s: Session, job, events: list[tuple[int, dict]], by_metric: dict, out) -> None:
        """A batch's metrics events of one job, (step, values) in order. Hot: each rule walks the
        values of its metric in a tight loop, and a message is written only when its alert opens or
        clears."""
        job_id = job.id  # once: an ORM attribute read costs
        for key, rules in by_metric.items():
            series = [(step, v) for step, values in events if (v := values.get(key)) is not None]
            if series:
                for r in rules:
                    if self._unchanged(s, r, job_id, series):
                        continue
                    for firing, step, v in self._changes(s, r, job_id, series):
                        self._fire(s, r, job, firing, self._message(r, job_id, firing, step, v), out)
                if rules and any((r.id, job_id) in self.open for r in rules):
                    self._now(s, rules, job_id, series[-1], out)

    def _now(self, s: Session, rules: list, job_id: int, latest: tuple[int, float], out) -> None:
        """An open alert keeps what it fired on ("loss = 7.63 > 5 since step 1") and says the latest
        value beside it ("; now 6.3 at step 100"), so it never reads as if the run stood still. Written
        at most every NOW_EVERY_S; a live frame, no webhook (nothing opened or cleared)."""
        now = time.time()
        step, v = latest
        for r in rules:
            key = (r.id, job_id)
            if key not in self.open or now - self.now_at.get(key, 0.0) < NOW_EVERY_S:
                continue
            tail = f"{NOW_SEP}{v:.6g} at step {step}"
            if getattr(out, "deferred", False):  # judged beside ingest: the writer rewrites it (store_changes)
                self.now_at[key] = now
                out.changes.append((job_id, None, {"now": r.kind, "tail": tail}))
                continue
            alert = s.scalar(select(Alert).where(Alert.job_id == job_id, Alert.kind == r.kind,
                                                 Alert.state != "cleared").order_by(Alert.id.desc()).limit(1))
            if alert is None:
                continue
            self.now_at[key] = now
            say_now(alert, tail, out)

    def bound_memory(self) -> None:
        """At most MAX_MEMORY (rule, job) memories (a window of values or a best each): the oldest
        made go, and are rebuilt from the stored series if their job logs again."""
        if len(self.memory) > MAX_MEMORY:
            keep = list(self.memory.items())[-(MAX_MEMORY // 2):]
            self.memory = dict(keep)

    def state_changed(self, s: Session, job, out) -> None:
        """A job's state changed outside an agent's report (the reaper's lost worker, a person's
        cancel of a queued job, a resume): its state rules judge it as they judge a reported one."""
        self.refresh(s)
        if self.rules and self.for_job(job)[1]:
            self.on_state(s, job, job.state, out)

    def on_state(self, s: Session, job, state: str, out) -> None:
        """A job's state changed (or its stall alert opened or cleared: state 'stalled' / 'not stalled')."""
        _, rules = self.for_job(job)
        stall = state in ("stalled", "not stalled")
        for r in rules:
            if (r.state == "stalled") != stall:
                continue  # a stall rule follows the stall alert; the others the job's state
            if r.state == state:
                self._fire(s, r, job, True, f"{r.name}: job {job.id} ({job.name}) is {state}", out)
            else:
                self._fire(s, r, job, False, f"job {job.id} is {state.replace('not stalled', 'moving again')}", out)

    def on_non_finite_alert(self, s: Session, job, metric: str, cleared: bool, out) -> None:
        by_metric, _ = self.for_job(job)
        for r in by_metric.get(metric, ()):
            if r.condition == "nonfinite":
                self._fire(s, r, job, not cleared, f"{r.name}: {metric} is finite again" if cleared
                           else f"{r.name}: {metric} is NaN or infinite (job {job.id})", out)

    def _unchanged(self, s: Session, r: Rule, job_id: int, series: list[tuple[int, float]]) -> bool:
        """The common case in one builtin pass: no value of the batch can change the alert's state.
        (A NaN makes max/min/sum answer 'maybe': the exact walk in _changes decides.)"""
        c, is_open = r.condition, (r.id, job_id) in self.open
        if c == "jump":
            return False
        values = [v for _, v in series]
        if c == "nonfinite":
            return not is_open and math.isfinite(sum(values))
        if c == "above":
            return max(values) <= r.threshold if not is_open else min(values) > r.threshold
        if c == "below":
            return min(values) >= r.threshold if not is_open else max(values) < r.threshold
        best = self.memory.get((r.id, job_id))
        if c == "no_improvement" and best is not None and best[0] is not None:
            none_better = min(values) >= best[0] if r.mode != "max" else max(values) <= best[0]
            return none_better and (is_open or series[-1][0] - best[1] < r.steps)
        return False

    def _changes(self, s: Session, r: Rule, job_id: int, series: list[tuple[int, float]]):
        """(fires?, step, value) at each value where the rule's verdict differs from its alert's state."""
        was, c, isfinite = (r.id, job_id) in self.open, r.condition, math.isfinite
        if c in ("above", "below", "nonfinite"):
            above, below, limit = c == "above", c == "below", r.threshold
            for step, v in series:
                if c == "nonfinite":
                    hit = not isfinite(v)
                elif not isfinite(v):
                    continue
                else:
                    hit = v > limit if above else v < limit if below else False
                if hit != was:
                    was = hit
                    yield hit, step, v
            return
        key = (r.id, job_id)
        if c == "no_improvement":
            best = self.memory.get(key) or self._rebuild_best(s, r, job_id)
            self.memory[key] = best
            lower = r.mode != "max"
            for step, v in series:
                if not isfinite(v):
                    continue
                if best[0] is None or (v < best[0] if lower else v > best[0]):
                    best[0], best[1] = v, step
                    hit = False
                elif step - best[1] >= r.steps:
                    hit = True
                else:
                    continue
                if hit != was:
                    was = hit
                    yield hit, step, v
        elif c == "jump":
            w = self.memory.get(key) or self._rebuild_window(s, r, job_id)
            self.memory[key] = w
            # Window.add and the z test inlined, on locals: the one rule that must see every value
            window, total, squares, sig2 = w.values, w.total, w.squares, r.sigmas * r.sigmas
            for step, v in series:
                if not isfinite(v):
                    continue
                n, hit = len(window), None
                if n >= JUMP_MIN:
                    mean = total / n
                    m2 = mean * mean
                    var = squares / n - m2
                    floor = 1e-24 * (m2 if m2 > 1.0 else 1.0)  # a flat series: any move is a jump, not a 0 division
                    if var < floor:
                        var = floor
                    d = v - mean
                    hit = d * d > sig2 * var
                    if hit:
                        w.last = (abs(d) / math.sqrt(var), mean)
                window.append(v)
                total += v
                squares += v * v
                if n >= JUMP_WINDOW:
                    old = window.popleft()
                    total -= old
                    squares -= old * old
                w.total, w.squares = total, squares
                if hit is not None and hit != was:
                    was = hit
                    yield hit, step, v

    def _message(self, r: Rule, job_id: int, firing: bool, step: int, v: float) -> str:
        """What an opening or clearing alert of a metric rule says (judged just before by _judge)."""
        c, m = r.condition, r.metric
        if c == "nonfinite":
            return f"{r.name}: {m} = {v} at step {step}" if firing else f"{m} finite again at step {step}"
        if c in ("above", "below"):
            return (f"{r.name}: {m} = {v:.6g} {'>' if c == 'above' else '<'} {r.threshold:g} since step {step}"
                    if firing else f"{m} = {v:.6g} at step {step}")
        memory = self.memory.get((r.id, job_id))
        if c == "no_improvement":
            best = memory or [v, step]
            return (f"{r.name}: {m} has not improved for {step - best[1]} steps (best {best[0]:.6g} at step "
                    f"{best[1]})" if firing else f"{m} improved to {v:.6g} at step {step}")
        z, mean = memory.last if isinstance(memory, Window) and memory.last else (0.0, v)
        return (f"{r.name}: {m} = {v:.6g} jumped {z:.1f} standard deviations from its recent mean {mean:.6g} "
                f"at step {step}" if firing else f"{m} back within {r.sigmas:g} standard deviations at step {step}")

    def _series(self, s: Session, metric: str, job_id: int, order: str, limit: int) -> list[tuple]:
        # the running attempt's finite points (an earlier attempt's are another run's history). The
        # range leaves out +-inf and NaN: PostgreSQL's, and SQLite's 'nan' text, sort above every number.
        return s.execute(text("SELECT m.step, m.value FROM metrics m JOIN metric_keys k ON k.id = m.key_id "
                              "WHERE m.job_id = :j AND k.name = :n AND m.value BETWEEN -1.7976931348623157e308 "
                              "AND 1.7976931348623157e308 AND m.attempt = (SELECT attempt FROM jobs "
                              f"WHERE id = :j) ORDER BY {order} LIMIT {int(limit)}"),
                         {"j": job_id, "n": metric}).all()

    def _rebuild_best(self, s: Session, r: Rule, job_id: int) -> list:
        """After a start: the best stored value and its first step (the point being judged may already be stored)."""
        rows = self._series(s, r.metric, job_id, "m.value DESC, m.step" if r.mode == "max" else "m.value, m.step", 1)
        return [rows[0][1], rows[0][0]] if rows else [None, 0]

    def _rebuild_window(self, s: Session, r: Rule, job_id: int) -> "Window":
        w = Window()
        for _, v in reversed(self._series(s, r.metric, job_id, "m.step DESC", JUMP_WINDOW + 1)[1:]):
            w.add(v)  # the newest stored point may be the one being judged now: left out
        return w

    def _fire(self, s: Session, r: Rule, job, firing: bool, message: str, out) -> None:
        key = (r.id, job.id)
        if firing == (key in self.open):
            return  # no change: no database work
        d = {"kind": r.kind, "severity": r.severity, "message": message[:2000]}
        if firing:
            self.open.add(key)
            self.now_at[key] = time.time()  # its message says the value it fired on: "now" comes later
        else:
            self.open.discard(key)
            self.now_at.pop(key, None)
            d["clear"] = True
        if getattr(out, "deferred", False):  # judged beside ingest: written after, in a write of its own
            out.changes.append((job.id, job.agent_id, d))
            return
        alert = upsert_alert(s, job.id, job.agent_id, d)
        if alert is not None:
            payload = alert_dict(alert)
            out.alerts.append(payload)
            out.frames.append((ALERTS_TOPIC, alert_frame(payload), False))


@dataclass
class Fired:
    """What rules fired outside ingest: alerts (for webhooks) and their frames. deferred: the
    alerts' changes are only collected (job id, agent id, upsert_alert's dict), for store_changes."""
    alerts: list = field(default_factory=list)
    frames: list = field(default_factory=list)
    deferred: bool = False
    changes: list = field(default_factory=list)


def store_changes(s: Session, changes: list, out: Fired) -> None:
    """Deferred alert changes written (in the writer's session); their alerts and frames into out."""
    for job_id, agent_id, d in changes:
        if "now" in d:  # an open alert's latest value: its message rewritten, a frame, no webhook
            open_alert = s.scalar(select(Alert).where(Alert.job_id == job_id, Alert.kind == d["now"],
                                                      Alert.state != "cleared").order_by(Alert.id.desc()).limit(1))
            if open_alert is not None:
                say_now(open_alert, d["tail"], out)
            continue
        alert = upsert_alert(s, job_id, agent_id, d)
        if alert is not None:
            payload = alert_dict(alert)
            out.alerts.append(payload)
            out.frames.append((ALERTS_TOPIC, alert_frame(payload), False))


def say_now(alert: Alert, tail: str, out) -> None:
    """What the alert fired on, then "; now <value> at step <n>"."""
    head, _, _ = alert.message.partition(NOW_SEP)
    alert.message = f"{head}{tail}"[:2000]
    out.frames.append((ALERTS_TOPIC, alert_frame(alert_dict(alert)), True))


@dataclass(frozen=True)
class JobRef:
    """What rules read of a job, taken in the writer (an ORM row must not cross threads)."""
    id: int
    name: Optional[str]
    owner_token_id: Optional[int]
    agent_id: Optional[int]


class Window:
    """The last JUMP_WINDOW values with running sums: a mean and a standard deviation in O(1)."""
    __slots__ = ("values", "total", "squares", "last")

    def __init__(self):
        self.values: deque = deque()
        self.total = self.squares = 0.0
        self.last: Optional[tuple[float, float]] = None  # the last jump's (z, mean): its message

    def add(self, v: float) -> None:
        self.values.append(v)
        self.total += v
        self.squares += v * v
        if len(self.values) > JUMP_WINDOW:
            old = self.values.popleft()
            self.total -= old
            self.squares -= old * old


RULES = Rules()
