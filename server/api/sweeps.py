"""Sweeps: submit (checked: a 422 names the field), list, inspect (trials, best so far, importance,
time saved by pruning), pause, resume, cancel. The trials are ordinary jobs (GET /api/jobs?sweep_id=)."""
from __future__ import annotations

import json
import time
from typing import Optional

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from server import store
from server.context import AppDep
from server.hub import job_frames
from server.models import Alert, Job, Sweep, SweepTrial
from server.security import UserDep, not_yours, require_command_rights
from server.sweeps import space, study as studies
from server.validate import check_spec_async
from tokenpulse.errors import SpecError
from tokenpulse.protocol import FINAL_STATES, JobState
from tokenpulse.sweep_spec import SweepSpec

router = APIRouter(prefix="/api/sweeps", tags=["sweeps"])


@router.post("", status_code=201)
async def create_sweep(spec: SweepSpec, tp: AppDep, caller: UserDep) -> dict:
    """Start a sweep: trials of the base job with settings from the space (grid, random or Optuna's
    TPE), judged by the objective, stopped early by the pruner, within the budget. Refused with a 422
    naming the field: an empty space, a log range over zero, a parameter the base job has not, an
    objective no trial would report, a base job that would not run."""
    if spec.is_command:
        require_command_rights(caller, "start a sweep of command jobs (each trial runs the command)")
    base = space.check(spec)
    first = space.trial_spec(spec, 0, 0, {n: space.corners(p)[0] for n, p in spec.parameters.items()})
    try:
        await check_spec_async(first, tp.settings)  # the base's paths and columns, as a submit checks them
    except SpecError as e:
        errors = [{**x, "field": f"base.{x['field']}"} for x in e.errors]
        raise SpecError(errors[0]["field"], errors[0]["message"], errors) from None
    name = spec.name or (base.name if base.name else "")

    def create(s):
        sw = Sweep(name=name or "sweep", project=spec.project, state="running", spec=spec.model_dump_json(),
                   owner_token_id=caller.principal_id, created_at=time.time())
        s.add(sw)
        s.flush()
        if not name:
            sw.name = f"sweep-{sw.id}"
        return sweep_row(sw)
    row = await tp.db.write(create)
    tp.sweeps.poke()
    return row


@router.get("")
def list_sweeps(tp: AppDep, _: UserDep, project: Optional[str] = Query(None, max_length=100)) -> list[dict]:
    with tp.db.read() as s:
        where = [Sweep.project == project] if project is not None else []
        sweeps = list(s.scalars(select(Sweep).where(*where).order_by(Sweep.id.desc()).limit(500)))
        trials: dict[int, list[SweepTrial]] = {sw.id: [] for sw in sweeps}
        for t in s.scalars(select(SweepTrial).where(SweepTrial.sweep_id.in_(list(trials)))):
            trials[t.sweep_id].append(t)
        return [{**sweep_row(sw), "trials": len(trials[sw.id]),
                 "best": best(SweepSpec.model_validate_json(sw.spec), trials[sw.id])} for sw in sweeps]


@router.get("/{sweep_id}")
def get_sweep(sweep_id: int, tp: AppDep, _: UserDep) -> dict:
    """The sweep and every trial: settings, state, objective, the step it was pruned at, its job's
    state, progress and open alerts; the best so far; hours the pruner saved."""
    with tp.db.read() as s:
        sw = sweep_or_404(s, sweep_id)
        spec = SweepSpec.model_validate_json(sw.spec)
        trials = list(s.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep_id).order_by(SweepTrial.number)))
        jobs = {j.id: j for j in s.scalars(select(Job).where(Job.sweep_id == sweep_id))}
        alerts: dict[int, list[str]] = {}
        verdicts = list(s.scalars(select(Alert).where(Alert.job_id.in_(list(jobs)))))
        for a in verdicts:
            if a.state != "cleared":
                alerts.setdefault(a.job_id, []).append(a.kind)
        rows = [trial_row(t, jobs.get(t.job_id), alerts.get(t.job_id, [])) for t in trials]
        saved_s = sum(r["saved_s"] or 0 for r in rows)
        return {**sweep_row(sw), "spec": json.loads(sw.spec), "trials": rows, "best": best(spec, trials),
                "budget_trials": studies.trial_budget(spec), "saved_hours": saved_s / 3600,
                "counts": {st: sum(1 for t in trials if t.state == st) for st in studies.STATES},
                **sweep_problems(verdicts, jobs, {t.job_id for t in trials if t.state == "running"})}


def sweep_problems(verdicts: list[Alert], jobs: dict[int, Job], running: set[int]) -> dict:
    """What the trials' verdicts cost across the sweep: hours lost to each cause (its share of the
    step time x the trial's training time), and each fix kind once ("apply to the remaining trials"),
    from an open verdict of a trial still running."""
    lost: dict[str, float] = {}
    fixes: dict[str, dict] = {}
    now = time.time()
    for a in verdicts:
        data = json.loads(a.data) if a.data else {}
        job = jobs.get(a.job_id)
        if job is not None and job.started_at:
            hours = ((job.finished_at or now) - job.started_at) / 3600
            for cost in data.get("costs") or []:
                lost[cost["cause"]] = lost.get(cost["cause"], 0.0) + cost["frac"] * hours
        if a.state == "cleared" or a.job_id not in running:
            continue
        for n, fix in enumerate(data.get("fixes") or [], 1):
            if fix.get("changes") and not fix.get("argv") and fix["kind"] not in fixes:
                fixes[fix["kind"]] = {"kind": fix["kind"], "title": fix.get("title"), "changes": fix["changes"],
                                      "alert_id": a.id, "n": n, "job_id": a.job_id}
    return {"lost_hours": lost, "fixes": list(fixes.values())}


class SweepFix(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alert_id: int = Field(description="a trial's verdict (an alert with fixes)")
    n: int = Field(1, ge=1, description="which of its fixes (1: the first)")


@router.post("/{sweep_id}/fix")
async def apply_to_remaining(sweep_id: int, body: SweepFix, tp: AppDep, caller: UserDep) -> dict:
    """A trial's verdict, applied once for the whole sweep: its fix's settings go into the base job,
    so every trial started from now on has them (the searched settings stay the sweep's). The trial
    itself is fixed on its own page, as any job."""
    def apply(s):
        sw = sweep_or_404(s, sweep_id)
        if not caller.owns(sw.owner_token_id):
            raise not_yours("change", f"sweep {sweep_id}", sw.owner_token_id)
        alert = s.get(Alert, body.alert_id)
        job = s.get(Job, alert.job_id) if alert is not None and alert.job_id else None
        if job is None or job.sweep_id != sweep_id:
            raise HTTPException(404, f"alert {body.alert_id} is no verdict on a trial of sweep {sweep_id}")
        fixes = (json.loads(alert.data) if alert.data else {}).get("fixes") or []
        if body.n > len(fixes) or not fixes[body.n - 1].get("changes"):
            raise SpecError("n", f"alert {body.alert_id} has no fix {body.n} that changes settings")
        spec = SweepSpec.model_validate_json(sw.spec)
        new = {k: v[1] for k, v in fixes[body.n - 1]["changes"].items() if k not in spec.parameters}
        if spec.is_command:
            raise SpecError("alert_id", "a command sweep's fixes change its script: fix a trial on its page")
        spec.base = {**spec.base, **new}
        space.check(spec)  # the fixed base must still make valid trials
        sw.spec = spec.model_dump_json()
        return {**sweep_row(sw), "applied": new}
    row = await tp.db.write(apply)
    tp.sweeps.forget(sweep_id)  # its study is rebuilt with the new base
    return row


@router.get("/{sweep_id}/importance")
def get_importance(sweep_id: int, tp: AppDep, _: UserDep) -> dict:
    """Each parameter's importance for the objective over the completed trials (Optuna's evaluator)."""
    with tp.db.read() as s:
        sw = sweep_or_404(s, sweep_id)
        trials = list(s.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep_id)))
    return {"sweep_id": sweep_id, "importance": studies.importance(SweepSpec.model_validate_json(sw.spec), trials)}


@router.post("/{sweep_id}/pause")
async def pause_sweep(sweep_id: int, tp: AppDep, caller: UserDep) -> dict:
    """No new trial starts; the running ones go on (pause them on their pages to stop them too)."""
    return await _set_state(tp, sweep_id, caller, "pause", {"running"}, "paused")


@router.post("/{sweep_id}/resume")
async def resume_sweep(sweep_id: int, tp: AppDep, caller: UserDep) -> dict:
    return await _set_state(tp, sweep_id, caller, "resume", {"paused"}, "running")


@router.post("/{sweep_id}/cancel")
async def cancel_sweep(sweep_id: int, tp: AppDep, caller: UserDep) -> dict:
    """No new trial; every queued or running trial cancelled (counted failed: the sweep was cancelled)."""
    return await _set_state(tp, sweep_id, caller, "cancel", {"running", "paused"}, "cancelled")


async def _set_state(tp, sweep_id: int, caller, action: str, allowed: set[str], new: str) -> dict:
    def apply(s):
        sw = sweep_or_404(s, sweep_id)
        if not caller.owns(sw.owner_token_id):
            raise not_yours(action, f"sweep {sweep_id}", sw.owner_token_id)
        if sw.state not in allowed:
            raise store.TransitionError(f"sweep {sweep_id} is {sw.state}; it cannot {action}")
        sw.state = new
        frames = []
        if new == "cancelled":
            now = time.time()
            sw.finished_at, sw.reason = now, "cancelled by user"
            running = select(SweepTrial).where(SweepTrial.sweep_id == sweep_id, SweepTrial.state == "running")
            for t in s.scalars(running):
                t.state, t.reason, t.finished_at = "failed", "the sweep was cancelled", now
                job = s.get(Job, t.job_id)
                if JobState(job.state) not in FINAL_STATES and job.requested_action != "cancel":
                    store.request_cancel(s, job)
                    frames += job_frames(store.job_summary(job))
        return sweep_row(sw), frames
    row, frames = await tp.db.write(apply)
    tp.hub.publish_all(frames)
    tp.sweeps.poke()
    return row


def sweep_or_404(s, sweep_id: int) -> Sweep:
    sw = s.get(Sweep, sweep_id)
    if sw is None:
        raise HTTPException(404, f"sweep {sweep_id} does not exist")
    return sw


def sweep_row(sw: Sweep) -> dict:
    spec = json.loads(sw.spec)
    return {"id": sw.id, "name": sw.name, "project": sw.project, "state": sw.state, "reason": sw.reason,
            "owner": sw.owner_token_id, "created_at": sw.created_at, "finished_at": sw.finished_at,
            "method": spec["method"], "objective": spec["objective"], "parameters": list(spec["parameters"]),
            "pruner": spec["pruner"]["kind"]}


def trial_row(t: SweepTrial, job: Optional[Job], alerts: list[str]) -> dict:
    return {"number": t.number, "job_id": t.job_id, "params": json.loads(t.params), "state": t.state,
            "value": t.value, "pruned_step": t.pruned_step, "reason": t.reason, "alerts": alerts,
            "job_state": job.state if job else None, "step": job.step if job else None,
            "total_steps": job.total_steps if job else None, "saved_s": _saved_s(t, job),
            "started_at": job.started_at if job else None, "finished_at": t.finished_at}


def _saved_s(t: SweepTrial, job: Optional[Job]) -> Optional[float]:
    """The time a pruned trial would still have trained, at its own pace up to the prune."""
    if t.state != "pruned" or job is None or not job.started_at or not job.total_steps or not t.pruned_step:
        return None
    spent = (job.finished_at or t.finished_at or time.time()) - job.started_at
    return max(0.0, spent / t.pruned_step * (job.total_steps - t.pruned_step))


def best(spec: SweepSpec, trials: list[SweepTrial]) -> Optional[dict]:
    """The best completed trial (a trial that never reported the objective is failed, never best)."""
    done = [t for t in trials if t.state == "complete" and t.value is not None]
    if not done:
        return None
    pick = min if spec.objective.goal == "min" else max
    t = pick(done, key=lambda t: t.value)
    return {"number": t.number, "job_id": t.job_id, "value": t.value, "params": json.loads(t.params)}

