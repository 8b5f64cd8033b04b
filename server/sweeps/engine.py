"""The sweep loop: the one owner of every sweep's Optuna study in this server process.

Each pass, per active sweep: the objective's new points of its running trials (read from the stored
metrics) are reported to the study and the pruner asked (a pruned trial's job is cancelled, the
reason naming the step and the pruner); trials whose jobs ended are told (completed: the objective's
last point; never reported: failed, saying so; failed or cancelled: failed with the job's reason);
then new trials are asked for while the budget and the parallel limit allow. A pass runs every
second while a sweep is active (every 10 s while none is), and at once when
ingest stores points or a state for a trial (`wake`, after the commit) or this process takes a sweep
(`poke`; one submitted to another server process is seen within 10 s).

All writes go through the writer thread (db.write), one transaction per sweep per pass; Optuna's own
calls run here, off the writer. If a write fails, the sweep's study is dropped and rebuilt from the
tables on the next pass (study.rebuild), exactly as after a restart.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import optuna
from optuna.trial import TrialState
from sqlalchemy import select

from server import store
from server.hub import job_frames
from server.models import Job, Metric, MetricKey, Sweep, SweepTrial
from server.rules import RULES, Fired
from server.sweeps import space, study as studies
from tokenpulse.protocol import FINAL_STATES, JobState, agent_topic, nudge_frame
from tokenpulse.sweep_spec import SweepSpec

log = logging.getLogger("tokenpulse.sweeps")
PASS_EVERY_S = 1.0
IDLE_PASS_EVERY_S = 10.0  # no active sweep: no reason to read the table every second
ACTIVE_SWEEP = ("running", "paused")


@dataclass
class Runtime:
    """One sweep's study in memory and where each running trial's objective has been read up to."""
    spec: SweepSpec
    study: optuna.Study
    trial_of_job: dict[int, int] = field(default_factory=dict)  # running trials: job id -> trial number
    seen_step: dict[int, int] = field(default_factory=dict)  # job id -> last step reported
    stopping: dict[int, str] = field(default_factory=dict)  # pruned trials' jobs until they end -> why


@dataclass
class Plan:
    """What a pass decided for one sweep, written in one transaction."""
    prune: dict[int, tuple[int, str]] = field(default_factory=dict)  # job id -> (step, reason)
    settle: dict[int, tuple[str, Optional[float], str]] = field(default_factory=dict)  # job -> state, value, reason
    attrs: dict[int, dict] = field(default_factory=dict)  # trial number -> Optuna's system_attrs now
    new: list[tuple[int, dict, dict]] = field(default_factory=list)  # (number, params, system_attrs)
    stopped: dict[int, str] = field(default_factory=dict)  # pruned trials' jobs that ended -> the reason
    finish: Optional[str] = None  # the sweep is over: why


class SweepEngine:
    def __init__(self, tp):
        self.tp = tp
        self.runtimes: dict[int, Runtime] = {}
        self.trial_jobs: set[int] = set()  # jobs of running trials: what `wake` listens for
        self._wake = asyncio.Event()
        self.active = True  # the last pass found an active sweep (a first pass runs within a second)

    def wake(self, job_ids: Iterable[int]) -> None:
        """From ingest, after the commit: a trial's points or state arrived; cheap for other jobs."""
        if not self._wake.is_set() and not self.trial_jobs.isdisjoint(job_ids):
            self._wake.set()

    def forget(self, sweep_id: int) -> None:
        """The sweep's spec changed (a fix for the remaining trials): its study is rebuilt next pass."""
        self.runtimes.pop(sweep_id, None)
        self._wake.set()

    def poke(self) -> None:
        """A sweep was submitted, paused, resumed or cancelled: a pass now."""
        self._wake.set()

    async def run(self, lock=None) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), PASS_EVERY_S if self.active else IDLE_PASS_EVERY_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if lock is not None and not lock.held:  # several processes on PostgreSQL: the reaper's leader
                self.runtimes.clear()
                continue
            try:
                await self.pass_once()
            except Exception:  # noqa: BLE001 - the loop outlives a bad pass; the sweep is rebuilt
                log.exception("sweep pass failed")
                self.runtimes.clear()

    async def pass_once(self) -> None:
        with self.tp.db.read() as s:
            sweeps = list(s.scalars(select(Sweep).where(Sweep.state.in_(ACTIVE_SWEEP))))
        self.active = bool(sweeps)
        for gone in set(self.runtimes) - {sw.id for sw in sweeps}:
            del self.runtimes[gone]
        jobs: set[int] = set()
        for sw in sweeps:
            try:
                await self._advance(sw)
            except Exception:  # noqa: BLE001 - one sweep's trouble never stalls the others
                log.exception("sweep %s: pass failed; its study is rebuilt next pass", sw.id)
                self.runtimes.pop(sw.id, None)
            rt = self.runtimes.get(sw.id)
            if rt is not None:
                jobs |= set(rt.trial_of_job)
        self.trial_jobs = jobs

    # ---- one sweep --------------------------------------------------------------------------------

    def _runtime(self, s, sw: Sweep) -> Runtime:
        rt = self.runtimes.get(sw.id)
        if rt is not None:
            return rt
        spec = SweepSpec.model_validate_json(sw.spec)
        trials = list(s.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sw.id)))
        series = {t.job_id: objective_points(s, t.job_id, spec.objective.metric) for t in trials}
        rt = Runtime(spec, studies.rebuild(spec, trials, series))
        for t in trials:
            if t.state == "running":
                rt.trial_of_job[t.job_id] = t.number
                rt.seen_step[t.job_id] = max((p[0] for p in series[t.job_id]), default=-1)
            elif t.state == "pruned" and t.finished_at is not None:
                rt.stopping[t.job_id] = t.reason or "pruned"
        self.runtimes[sw.id] = rt
        return rt

    async def _advance(self, sw: Sweep) -> None:
        plan = Plan()
        with self.tp.db.read() as s:
            rt = self._runtime(s, sw)
            jobs = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_([*rt.trial_of_job, *rt.stopping])))}
            for job_id, reason in rt.stopping.items():
                if job_id not in jobs or JobState(jobs[job_id].state) in FINAL_STATES:
                    plan.stopped[job_id] = reason
            for job_id, number in list(rt.trial_of_job.items()):
                job = jobs.get(job_id)
                if job is None:
                    continue
                self._feed(s, rt, job, number, plan)
                if JobState(job.state) in FINAL_STATES and job_id not in plan.prune:
                    self._settle(s, rt, job, number, plan)
            running = len(rt.trial_of_job) - len(plan.prune) - len(plan.settle)
        self._ask(sw, rt, running, len(rt.stopping) - len(plan.stopped) + len(plan.prune), plan)
        if not (plan.prune or plan.settle or plan.new or plan.finish or plan.attrs or plan.stopped):
            return
        frames, nudges = await self.tp.db.write(lambda s: self._write(s, sw.id, rt, plan))
        for job_id, (_, reason) in plan.prune.items():
            rt.trial_of_job.pop(job_id, None)
            rt.stopping[job_id] = reason
        for job_id in plan.stopped:
            rt.stopping.pop(job_id, None)
        for job_id in plan.settle:
            rt.trial_of_job.pop(job_id, None)
        self.tp.hub.publish_all(frames)
        for agent_id in nudges:  # an agent on a websocket asks for its commands (the prune's cancel) now
            self.tp.hub.publish(agent_topic(agent_id), nudge_frame(), droppable=False)
        if plan.new:
            from server.api.agent_ws import work_queued
            work_queued(self.tp)
        if plan.finish:
            self.runtimes.pop(sw.id, None)

    def _feed(self, s, rt: Runtime, job: Job, number: int, plan: Plan) -> None:
        """The objective's new points of one running trial, reported; the pruner asked once."""
        points = objective_points(s, job.id, rt.spec.objective.metric, after=rt.seen_step.get(job.id, -1))
        if not points:
            return
        trial = optuna.trial.Trial(rt.study, frozen(rt, number)._trial_id)
        judge = JobState(job.state) not in FINAL_STATES and rt.spec.pruner.kind != "none"
        for step, value in points:  # as an objective function would: report each step, then ask
            trial.report(value, step)
            rt.seen_step[job.id] = step
            if judge and trial.should_prune():
                tell(rt.study, number, state=TrialState.PRUNED)
                plan.prune[job.id] = (step, f"pruned at step {step} by the {rt.spec.pruner.kind} pruner: "
                                            f"{rt.spec.objective.metric} {value:.4g} was "
                                            f"{'above' if rt.spec.objective.goal == 'min' else 'below'} "
                                            "what the other trials had at that step")
                break
        plan.attrs[number] = dict(frozen(rt, number).system_attrs)  # a halving pruner's rungs

    def _settle(self, s, rt: Runtime, job: Job, number: int, plan: Plan) -> None:
        """A trial whose job ended: told to the study with its outcome."""
        metric = rt.spec.objective.metric
        points = objective_points(s, job.id, metric)
        if job.state == JobState.completed.value and points:
            value = points[-1][1]
            tell(rt.study, number, value)
            plan.settle[job.id] = ("complete", value, f"{metric} {value:.4g} at step {points[-1][0]}")
            return
        if job.state == JobState.completed.value:
            reason = f"completed without reporting {metric}: counted as failed, never as best"
        else:
            reason = f"job {job.state}: {job.reason or job.failure or 'no reason given'}"
        tell(rt.study, number, state=TrialState.FAIL)
        plan.settle[job.id] = ("failed", None, reason)

    def _ask(self, sw: Sweep, rt: Runtime, running: int, stopping: int, plan: Plan) -> None:
        """New trials while the budget and the parallel limit allow (a pruned trial's job still
        stopping holds no place); the sweep is over once its budget is spent and every job ended."""
        spec = rt.spec
        total = len(rt.study.trials)
        out_of_time = spec.budget.hours is not None and time.time() - sw.created_at > spec.budget.hours * 3600
        if total >= studies.trial_budget(spec) or out_of_time:
            if running == 0 and stopping == 0:
                plan.finish = "the time budget is spent" if out_of_time else f"all {total} trials ran"
            return
        if sw.state != "running":
            return
        dists = studies.distributions(spec)
        while running < spec.budget.parallel and total < studies.trial_budget(spec):
            studies.before_ask(rt.study, spec)
            trial = rt.study.ask(dists)
            plan.new.append((trial.number, dict(trial.params), dict(frozen(rt, trial.number).system_attrs)))
            running += 1
            total += 1

    def _write(self, s, sweep_id: int, rt: Runtime, plan: Plan) -> tuple[list, set]:
        """The pass's decisions for one sweep, in one transaction (the writer thread)."""
        now = time.time()
        frames: list = []
        nudges: set[int] = set()
        sw = s.get(Sweep, sweep_id)
        trials = {t.job_id: t for t in s.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep_id))}
        by_number = {t.number: t for t in trials.values()}
        for number, attrs in plan.attrs.items():
            if number in by_number:
                by_number[number].system_attrs = json.dumps(attrs)
        fired = Fired()
        for job_id, (step, reason) in plan.prune.items():
            t, job = trials[job_id], s.get(Job, job_id)
            t.state, t.pruned_step, t.reason, t.finished_at = "pruned", step, reason, now
            if JobState(job.state) not in FINAL_STATES and job.requested_action != "cancel":
                before = job.state
                store.request_cancel(s, job)
                job.reason = reason
                if job.state != before:
                    RULES.state_changed(s, job, fired)
                if job.agent_id is not None:
                    nudges.add(job.agent_id)
            frames += job_frames(store.job_summary(job))
        for job_id, reason in plan.stopped.items():  # its own words were the agent's SIGTERM: say why
            job = s.get(Job, job_id)
            if job is not None and job.state == JobState.cancelled.value:
                job.reason = reason
                frames += job_frames(store.job_summary(job))
        for job_id, (state, value, reason) in plan.settle.items():
            t = trials[job_id]
            t.state, t.value, t.reason, t.finished_at = state, value, reason, now
        for number, params, attrs in plan.new:
            job = store.create_job(s, space.trial_spec(rt.spec, sweep_id, number, params),
                                   owner=sw.owner_token_id, sweep_id=sweep_id)
            s.add(SweepTrial(sweep_id=sweep_id, number=number, job_id=job.id, params=json.dumps(params),
                             system_attrs=json.dumps(attrs), state="running", created_at=now))
            rt.trial_of_job[job.id] = number
            rt.seen_step[job.id] = -1
            frames += job_frames(store.job_summary(job))
        if plan.finish and sw.state in ACTIVE_SWEEP:
            sw.state, sw.reason, sw.finished_at = "completed", plan.finish, now
        return frames + fired.frames, nudges


def tell(study: optuna.Study, number: int, value: Optional[float] = None, state: Optional[TrialState] = None) -> None:
    """study.tell, where the grid sampler's study.stop() on its last point (meant to end
    study.optimize, which never runs here) is no error: the trial is stored before it raises, and
    the sweep's own budget ends the grid (study.trial_budget)."""
    try:
        study.tell(number, value, state=state)
    except RuntimeError as e:
        if "Study.stop" not in str(e):
            raise


def frozen(rt: Runtime, number: int) -> optuna.trial.FrozenTrial:
    """Trial `number` as the study holds it, not copied (study.trials deep-copies every trial)."""
    return rt.study.get_trials(deepcopy=False)[number]


def objective_points(s, job_id: int, metric: str, after: int = -1) -> list[tuple[int, float]]:
    """The trial's stored finite points of the objective after a step, oldest first (a stored NaN/inf
    is shown on the job; the study is told numbers only, as before they were stored)."""
    key = s.scalar(select(MetricKey.id).where(MetricKey.name == metric))
    if key is None:
        return []
    rows = s.execute(select(Metric.step, Metric.value).where(Metric.job_id == job_id, Metric.key_id == key,
                                                             Metric.step > after).order_by(Metric.step))
    points = ((int(step), float(value)) for step, value in rows)
    return [(step, v) for step, v in points if math.isfinite(v)]
