"""Fixes applied to jobs and what they changed (server/fixes.py): POST /api/jobs/{id}/fix,
GET /api/jobs/{id}/changes; what the open verdicts cost right now: GET /api/costs."""
from __future__ import annotations

import json
from typing import Any, Optional

from fastapi import APIRouter
from pydantic import Field
from sqlalchemy import select

from server import fixes, store
from server.api.agent_ws import work_queued
from server.api.jobs import check_owner, get_job_or_404
from server.context import AppDep
from server.hub import job_frames
from server.models import Alert, Job
from server.schemas import Answer, JobSummary
from server.security import UserDep, require_command_rights
from tokenpulse.protocol import COMMAND, FixRequest, JobState, agent_topic, nudge_frame

router = APIRouter(tags=["jobs"])


class ChangeOut(Answer):
    id: int
    job_id: int
    kind: str = Field(description="padding, micro_batch, precision, eval, workers, group_by_length, revert")
    state: str = Field(description="pending (waiting for the checkpoint), applied, dropped (the attempt ended first)")
    alert_id: Optional[int]
    reverts: Optional[int] = Field(description="the change this one undoes")
    title: Optional[str]
    changes: dict[str, Any] = Field(description="{setting: [old, new]}")
    argv: Optional[list] = Field(description="a command job's [old argv, new argv]")
    effect: Optional[str] = Field(description="the predicted effect, from what the verdict measured")
    resume: str = Field(description="checkpoint (resumes where it paused) or fresh (from step 0)")
    why_fresh: Optional[str]
    by: Optional[int] = Field(description="the token that asked")
    by_name: Optional[str] = Field(None, description="that token's name (in a job's history of changes)")
    created_at: float
    applied_at: Optional[float]
    from_attempt: Optional[int]
    to_attempt: Optional[int]
    resume_step: Optional[int] = Field(description="the new attempt's steps come after this one")
    comparison: Optional[dict[str, Any]] = Field(description="before/after (tokens/s, step time, memory, loss, ETA) "
                                                             "and the verdict, once the new attempt ran long "
                                                             "enough past its warm-up")


class FixAnswer(Answer):
    job: JobSummary
    change: ChangeOut


class CostOut(Answer):
    job_id: int
    name: str
    cause: str
    frac: float = Field(description="the share of each step it costs")
    hours: Optional[float] = Field(description="frac x the job's remaining ETA")


class CostsOut(Answer):
    jobs: list[CostOut]
    by_cause: dict[str, float] = Field(description="hours being lost now, summed over running jobs, by cause")
    total_hours: float


@router.post("/api/jobs/{job_id}/fix")
async def apply_fix(job_id: int, body: FixRequest, tp: AppDep, caller: UserDep) -> FixAnswer:
    """Apply a verdict's fix: the job saves a checkpoint, stops, and is relaunched at once with the
    change, from that checkpoint (or from step 0 where the fix says the checkpoint cannot serve).
    revert: undo the newest applied fix. 409 when the job's state does not allow it. The changed
    settings pass a submit's checks (paths under path_roots, finite numbers, no credentials): 422."""
    def allowed(s):
        job = get_job_or_404(s, job_id)
        check_owner(caller, job, "change")
        if job.kind == COMMAND:
            require_command_rights(caller, "change a command job's command")
        return job

    checked = None
    if not body.revert:  # the new spec checked as a submit is, off the writer (files, maybe the Hub)
        with tp.db.read() as s:
            job = allowed(s)
            alert, fix = fixes.choose(s, job, body.alert_id, body.kind, body.n)
            checked = fixes.changed_spec(job, fix)[0]
        await fixes.check_like_a_submit(job, checked, tp.settings)

    def apply(s):
        job = allowed(s)
        if body.revert:
            change = fixes.revert(s, job, caller.principal_id)
        else:
            alert, fix = fixes.choose(s, job, body.alert_id, body.kind, body.n)
            if fixes.changed_spec(job, fix)[0] != checked:
                raise store.TransitionError(f"job {job_id} or its fix changed meanwhile; ask again")
            change = fixes.request(s, job, fix, alert.id, caller.principal_id)
        return store.job_summary(job), fixes.change_dict(change, None)
    summary, change = await tp.db.write(apply)
    tp.hub.publish_all(job_frames(summary))
    if summary["agent_id"] is not None:  # the agent hears of the pause at once
        tp.hub.publish(agent_topic(summary["agent_id"]), nudge_frame(), droppable=False)
    if summary["state"] == JobState.queued.value:
        work_queued(tp)
    return {"job": summary, "change": change}


@router.get("/api/jobs/{job_id}/changes")
def list_changes(job_id: int, tp: AppDep, _: UserDep) -> list[ChangeOut]:
    """Every change applied to the job (who, what, when), each with its before/after comparison."""
    with tp.db.read() as s:
        get_job_or_404(s, job_id)
        return fixes.history(s, job_id)


@router.get("/api/costs")
def costs(tp: AppDep, _: UserDep) -> CostsOut:
    """What the open slow verdicts of running jobs cost now: each cause's share of the step time times
    the job's remaining ETA, summed by cause."""
    with tp.db.read() as s:
        rows = s.execute(select(Alert, Job).join(Job, Job.id == Alert.job_id).where(
            Alert.state != "cleared", Alert.data.is_not(None),
            Job.state.in_([JobState.running.value, JobState.starting.value]))).all()
        out, by = [], {}
        for a, job in rows:
            last = json.loads(job.last) if job.last else {}
            eta = last.get("eta_s")
            for c in json.loads(a.data).get("costs") or []:
                frac = c.get("frac")
                if not isinstance(frac, (int, float)):
                    continue
                hours = frac * eta / 3600 if isinstance(eta, (int, float)) else None
                out.append({"job_id": job.id, "name": job.name, "cause": str(c.get("cause")), "frac": frac,
                            "hours": hours})
                if hours is not None:
                    by[str(c.get("cause"))] = by.get(str(c.get("cause")), 0.0) + hours
    return {"jobs": out, "by_cause": by, "total_hours": sum(by.values())}
