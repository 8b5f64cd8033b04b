"""Alert rules people write, evaluated on ingest (issue 22, item 2).

A rule has a scope (all jobs, a job-name glob, one job), a condition (a metric above or below a
value, no improvement for N steps, a jump of K standard deviations, NaN or infinite, a job state),
a severity and webhook channels. A firing rule opens an alert of kind `rule:<id>` on its job through
ingest/alerts.py's upsert_alert, and clears it when the condition no longer holds: the same
open/update/clear life and the same webhook rules (open and clear only) as built-in alerts.

Cheap on the ingest path: the rules live in memory (reloaded after a change here, and every
REFRESH_S for other server processes); a job's applicable rules are computed once per job and rule
set; only rules whose metric is in the batch are looked at; the database is touched only when an
alert opens or clears, or once per (rule, job) to rebuild a rule's memory (best value, recent values)
from the stored series after a start.
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
from server.models import AlertRule
from tokenpulse.protocol import ALERTS_TOPIC, alert_frame

REFRESH_S = 5.0  # another server process's rule change is seen within this
JUMP_WINDOW = 50  # values a jump is measured against
JUMP_MIN = 10  # values needed before a jump can be judged
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

    # ---- the rule set ----------------------------------------------------------------------------
    def changed(self) -> None:
        self.loaded_at = -math.inf

    def refresh(self, s: Session) -> None:
        now = time.monotonic()
        if now - self.loaded_at < REFRESH_S:
            return
        self.loaded_at = now
        rules = {r.id: Rule.of(r) for r in s.scalars(select(AlertRule))}
        if rules != self.rules:
            self.rules, self.version = rules, self.version + 1
            self.per_job.clear()
            self.memory = {k: v for k, v in self.memory.items() if k[0] in rules}
        self.open = {(int(kind[len(KIND_PREFIX):]), job_id) for job_id, kind in s.execute(text(
            "SELECT job_id, kind FROM alerts WHERE kind LIKE 'rule:%' AND state != 'cleared' AND job_id IS NOT NULL"))}

    def for_job(self, job) -> tuple[dict, list]:
        hit = self.per_job.get(job.id)
        if hit is not None and hit[0] == self.version and hit[1] == job.name:
            return hit[2], hit[3]
        by_metric: dict[str, list[Rule]] = {}
        states: list[Rule] = []
        for r in self.rules.values():
            if r.applies_to(job.id, job.name):
                if r.condition == "state":
                    states.append(r)
                else:
                    by_metric.setdefault(r.metric, []).append(r)
        if len(self.per_job) > 10_000:
            self.per_job.clear()
        self.per_job[job.id] = (self.version, job.name, by_metric, states)
        return by_metric, states

    def channels_for(self, alert: dict) -> list[dict]:
        kind = alert.get("kind") or ""
        if not kind.startswith(KIND_PREFIX):
            return []
        rule = self.rules.get(int(kind[len(KIND_PREFIX):]) if kind[len(KIND_PREFIX):].isdigit() else -1)
        return rule.channels if rule is not None else []

    # ---- evaluation ----------------------------------------------------------------------------
    def on_metrics(self, s: Session, job, step: int, values: dict, by_metric: dict, out) -> None:
        for key, rules in by_metric.items():
            v = values.get(key)
            if v is None:
                continue
            for r in rules:
                verdict = self._judge(s, r, job.id, step, v)
                if verdict is not None:
                    self._fire(s, r, job, *verdict, out)

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

    def _judge(self, s: Session, r: Rule, job_id: int, step: int, v: float) -> Optional[tuple[bool, str]]:
        """(fires?, message) when this value says something; None when nothing changes."""
        c = r.condition
        if c == "nonfinite":
            bad = not math.isfinite(v)
            return bad, (f"{r.name}: {r.metric} = {v} at step {step}" if bad else f"{r.metric} finite again at step {step}")
        if not math.isfinite(v):
            return None
        if c in ("above", "below"):
            hit = v > r.threshold if c == "above" else v < r.threshold
            return hit, (f"{r.name}: {r.metric} = {v:.6g} {'>' if c == 'above' else '<'} {r.threshold:g} at step {step}"
                         if hit else f"{r.metric} = {v:.6g} at step {step}")
        key = (r.id, job_id)
        if c == "no_improvement":
            best = self.memory.get(key) or self._rebuild_best(s, r, job_id)
            self.memory[key] = best
            better = best[0] is None or (v < best[0] if r.mode != "max" else v > best[0])
            if better:
                best[0], best[1] = v, step
                return False, f"{r.metric} improved to {v:.6g} at step {step}"
            if step - best[1] >= r.steps:
                return True, (f"{r.name}: {r.metric} has not improved for {step - best[1]} steps "
                              f"(best {best[0]:.6g} at step {best[1]})")
            return None
        if c == "jump":
            w = self.memory.get(key) or self._rebuild_window(s, r, job_id)
            self.memory[key] = w
            verdict = w.judge(v, r.sigmas)
            w.add(v)
            if verdict is None:
                return None
            z, mean = verdict
            return (z > r.sigmas, f"{r.name}: {r.metric} = {v:.6g} jumped {z:.1f} standard deviations from "
                                  f"its recent mean {mean:.6g} at step {step}" if z > r.sigmas
                    else f"{r.metric} back within {r.sigmas:g} standard deviations at step {step}")
        return None

    def _series(self, s: Session, metric: str, job_id: int, order: str, limit: int) -> list[tuple]:
        return s.execute(text("SELECT m.step, m.value FROM metrics m JOIN metric_keys k ON k.id = m.key_id "
                              f"WHERE m.job_id = :j AND k.name = :n ORDER BY {order} LIMIT {int(limit)}"),
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
        else:
            self.open.discard(key)
            d["clear"] = True
        alert = upsert_alert(s, job.id, job.agent_id, d)
        if alert is not None:
            payload = alert_dict(alert)
            out.alerts.append(payload)
            out.frames.append((ALERTS_TOPIC, alert_frame(payload), False))


@dataclass
class Fired:
    """What rules fired outside ingest: alerts (for webhooks) and their frames."""
    alerts: list = field(default_factory=list)
    frames: list = field(default_factory=list)


class Window:
    """The last JUMP_WINDOW values with running sums: a mean and a standard deviation in O(1)."""
    __slots__ = ("values", "total", "squares")

    def __init__(self):
        self.values: deque = deque()
        self.total = self.squares = 0.0

    def add(self, v: float) -> None:
        self.values.append(v)
        self.total += v
        self.squares += v * v
        if len(self.values) > JUMP_WINDOW:
            old = self.values.popleft()
            self.total -= old
            self.squares -= old * old

    def judge(self, v: float, sigmas: float) -> Optional[tuple[float, float]]:
        n = len(self.values)
        if n < JUMP_MIN:
            return None
        mean = self.total / n
        std = math.sqrt(max(self.squares / n - mean * mean, 0.0))
        std = max(std, 1e-12 * max(abs(mean), 1.0))  # a flat series: any move is a jump, not a division by zero
        return abs(v - mean) / std, mean


RULES = Rules()
