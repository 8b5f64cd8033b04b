"""Jobs: submit, list, inspect, control; their metrics and events."""
from __future__ import annotations

import json
from typing import Literal, Optional

import orjson
from fastapi import APIRouter, HTTPException, Query, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import func, or_, select

from server import gang, job_columns, store
from server.analysis_pool import pool_of
from server.api.agent_ws import work_queued
from server.context import AppDep
from server.dialect import raw_cursor
from server.errors import error_list, unprocessable
from server.hub import job_frames
from server.models import Attempt, Event as EventRow, Job, MetricKey, MetricRollup
from server.preflight import preflight
from server.rules import RULES, Fired
from server.schemas import EventsOut, JobDetail, JobList, JobSummary, MetricsOut, Submitted
from server.security import CommandsDep, UserDep, not_yours, require_command_rights
from server.series import read_run
from server.validate import check_spec_async
from tokenpulse.protocol import (
    COMMAND,
    EXTERNAL,
    JOB_KINDS,
    JOBS_TOPIC,
    MAX_TAGS,
    CommandSpec,
    JobSpec,
    JobState,
    ProjectName,
    TagName,
    agent_topic,
    job_frame,
    nudge_frame,
)

router = APIRouter(prefix="/api/jobs", tags=["jobs"])


class JobMetaEdit(BaseModel):
    """A job's project, tags and note (PATCH /api/jobs/{id}): only the fields given change."""
    model_config = ConfigDict(extra="forbid")
    project: Optional[ProjectName] = None
    tags: Optional[list[TagName]] = Field(None, max_length=MAX_TAGS, description="replace every tag")
    add_tags: list[TagName] = Field(default_factory=list, max_length=MAX_TAGS)
    remove_tags: list[TagName] = Field(default_factory=list, max_length=MAX_TAGS)
    note: Optional[str] = Field(None, max_length=100_000, description="markdown")


class CloneRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # {"set": ...} instead of "changes" must not clone silently
    changes: dict = Field(default_factory=dict, description="JobSpec (or, for a command job, CommandSpec) "
                                                            "fields to change in the copy")


def job_detail(job: Job, attempts: list[Attempt]) -> dict:
    d = store.job_summary(job, last=None)  # one job's page: every latest value
    d["spec"] = json.loads(job.spec)
    d["info"] = json.loads(job.info) if job.info else {}
    d["note"] = job.note or ""
    d["attempts"] = [{"attempt": a.attempt, "agent_id": a.agent_id, "started_at": a.started_at,
                      "ended_at": a.ended_at, "outcome": a.outcome, "reason": a.reason,
                      "failure": a.failure, "exit_code": a.exit_code, "signal": a.signal,
                      "resumed_from": a.resumed_from, "failure_class": a.failure_class,
                      "change": json.loads(a.change) if a.change else None, "decision": a.decision,
                      "hang_step": a.hang_step, "hang_frame": a.hang_frame, "peak_mb": a.peak_mb,
                      "checkpoint_s": a.checkpoint_s} for a in attempts]
    return d


def get_job_or_404(s, job_id: int) -> Job:
    job = s.get(Job, job_id)
    if job is None:
        raise HTTPException(404, f"job {job_id} does not exist")
    return job


async def submit(tp, spec, caller, parent_id: Optional[int] = None) -> dict:
    spec = await check_spec_async(spec, tp.settings)  # a SpecError is a 422 naming the field (server/errors.py)

    def create(s):
        job = store.create_job(s, spec, parent_id, owner=caller.principal_id)
        if job.nnodes > 1:
            job.reason = gang.trusted_shortage(s, job.nnodes)
        return job_detail(job, [])
    detail = await tp.db.write(create)
    tp.hub.publish(JOBS_TOPIC, job_frame({k: v for k, v in detail.items() if k not in ("spec", "info")}),
                   droppable=False)
    work_queued(tp)  # an idle agent on its websocket claims it now
    if not isinstance(spec, JobSpec):
        return detail  # a command job: nothing to analyze
    # after the job is queued (an agent may start it meanwhile): advice, never a refusal
    return {**detail, **await preflight(spec, tp.settings, tp.db, pool_of(tp), caller.principal_id)}


@router.post("", status_code=201)
async def create_job(spec: JobSpec, tp: AppDep, caller: UserDep) -> Submitted:
    """Queue a job. The answer carries `warnings`: preflight advice (padding waste, truncation, a
    batch size far from what was measured, streaming with epochs), each with the field and the fix;
    the job runs as asked regardless."""
    return await submit(tp, spec, caller)


@router.post("/command", status_code=201)
async def create_command_job(spec: CommandSpec, tp: AppDep, caller: CommandsDep) -> JobDetail:
    """Run your own command (a training script, `accelerate launch ...`, `trl sft ...`) on an agent,
    supervised like any job: queued, claimed, its output logged, its exit judged, cancellable.

    This is code execution on the agent's machine: the token needs the `commands` scope (403
    otherwise), and only agents started with --allow-commands take command jobs. `cwd` must lie
    under the server's path_roots. `secret_env` names variables the agent copies from its own
    environment: their values never reach the server."""
    return await submit(tp, spec, caller)


@router.get("")
def list_jobs(tp: AppDep, _: UserDep,
              state: Optional[list[JobState]] = Query(None, description="filter by state (repeatable)"),
              q: Optional[str] = Query(None, max_length=200,
                                       description="search: a name fragment, or a job id (`4` or `#4`)"),
              limit: int = Query(50, ge=1, le=1000), offset: int = Query(0, ge=0),
              spec: bool = Query(False,
                                 description="include each job's settings (the jobs list's columns)"),
              sort: Optional[str] = Query(None, max_length=210, description=(
                  "sort every job (not the page) by a setting or latest metric: `spec:learning_rate`, "
                  "`last:eval/loss`; numbers as numbers, blanks last; default newest first")),
              desc: bool = Query(False, description="with sort: largest first"),
              filter: Optional[list[str]] = Query(None, max_length=20, description=(
                  "column filters (repeatable): `last:loss<0.5`, `spec:learning_rate>=1e-4`, "
                  "`spec:model~gpt` (the text contains it)")),
              project: Optional[str] = Query(None, max_length=100, description="only this project's jobs"),
              tag: Optional[list[str]] = Query(None, max_length=20, description="only jobs with every tag "
                                                                                  "given (repeatable)"),
              sweep_id: Optional[int] = Query(None, description="only this sweep's trials"),
              columns: Optional[list[str]] = Query(None, max_length=50, description=(
                  "latest metrics each row's `last` carries besides the listed ones (loss, eval/loss, lr, "
                  "tokens_per_s, eta_s...): `last:grad_norm` or `grad_norm` (repeatable)")),
              names: bool = Query(False, description="include `metric_names`: the names the page's jobs "
                                                     "logged (at most 1,000), for a column picker")) -> JobList:
    with tp.db.read() as s:
        where = [job_columns.filter_clause(f, tp.db.dialect) for f in filter or []]
        if project is not None:
            where.append(Job.project == project)
        for t in tag or []:  # tags are a JSON list: its quoted item in the text
            where.append(Job.tags.contains(json.dumps(t), autoescape=True))
        if sweep_id is not None:
            where.append(Job.sweep_id == sweep_id)
        if state:
            where.append(Job.state.in_([x.value for x in state]))
        q = job_columns.printable("q", (q or "").strip())
        digits = q.removeprefix("#").strip()
        the_id = int(digits) if digits.isascii() and digits.isdigit() and len(digits) < 19 else -1
        if q.startswith("#") and the_id >= 0:
            where.append(Job.id == the_id)  # "#4" means job 4, not every name with a 4 in it
        elif q:
            where.append(or_(Job.name.contains(q), Job.id == the_id))
        total = s.scalar(select(func.count()).select_from(Job).where(*where))
        order = job_columns.order_by(sort, desc, tp.db.dialect) if sort else [Job.id.desc()]
        rows = list(s.scalars(select(Job).where(*where).order_by(*order).limit(limit).offset(offset)))
        # The agent that ran each job's latest attempt: a finished job no longer holds one, but the
        # list still says where it ran.
        ran_on = dict(s.execute(select(Attempt.job_id, Attempt.agent_id)
                                .where(Attempt.job_id.in_([j.id for j in rows]))
                                .order_by(Attempt.job_id, Attempt.attempt)).all()) if rows else {}
        shown = store.LISTED_LAST + tuple(job_columns.printable("columns", c).removeprefix("last:")
                                          for c in columns or ())
        out = JobList(total=total, jobs=[{**store.job_summary(j, shown), "last_agent_id": ran_on.get(j.id),
                                          **({"spec": json.loads(j.spec)} if spec else {})} for j in rows])
        if names:
            out.metric_names = sorted({k for j in rows for k in store.latest(j, None) if k != "step"})[:1000]
        return out


@router.get("/{job_id}")
def get_job(job_id: int, tp: AppDep, _: UserDep) -> JobDetail:
    with tp.db.read() as s:
        job = get_job_or_404(s, job_id)
        attempts = list(s.scalars(select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.attempt)))
        return job_detail(job, attempts)


@router.patch("/{job_id}")
async def edit_job(job_id: int, body: JobMetaEdit, tp: AppDep, caller: UserDep) -> JobDetail:
    """Move a job to another project, set or change its tags, write its note (markdown). Its owner's
    or an admin's, as every change to a job is."""
    def apply(s):
        job = get_job_or_404(s, job_id)
        check_owner(caller, job, "edit")
        if body.project is not None:
            job.project = body.project
        tags = body.tags if body.tags is not None else (json.loads(job.tags) if job.tags else [])
        tags = [t for t in dict.fromkeys(tags + body.add_tags) if t not in body.remove_tags]
        if len(tags) > MAX_TAGS:
            raise unprocessable([{"field": "add_tags", "message": f"at most {MAX_TAGS} tags on a job"}])
        job.tags = json.dumps(tags)
        if body.note is not None:
            job.note = body.note
        attempts = list(s.scalars(select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.attempt)))
        return job_detail(job, attempts)
    detail = await tp.db.write(apply)
    tp.hub.publish_all(job_frames({k: v for k, v in detail.items() if k not in ("spec", "info", "attempts", "note")}))
    return detail


def check_owner(caller, job: Job, action: str) -> None:
    """Everyone reads every job (a team dashboard); only its owner or an admin changes its course."""
    if not caller.owns(job.owner_token_id):
        raise not_yours(action, f"job {job.id}", job.owner_token_id)


async def request_action(tp, job_id: int, action: str, caller) -> dict:
    """A person's cancel/pause/resume/stack on a job they own (or any, as admin): the state machine
    decides (store.REQUESTS); a refusal is its TransitionError, answered 409 by server/errors.py."""
    def apply(s):
        job = get_job_or_404(s, job_id)
        check_owner(caller, job, action)
        if action == "resume" and job.kind == COMMAND:
            require_command_rights(caller, "resume a command job (it starts the command again)")
        before = job.state
        store.REQUESTS[action](s, job)
        if job.state != before:  # a queued job cancelled, a paused one resumed: rules on states judge it
            RULES.state_changed(s, job, fired)
        return store.job_summary(job)
    fired = Fired()
    summary = await tp.db.write(apply)
    tp.hub.publish_all(fired.frames + job_frames(summary))
    if tp.webhooks is not None:
        tp.webhooks.send_all(fired.alerts)
    if summary["agent_id"] is not None:  # an agent on a websocket asks for its commands at once
        tp.hub.publish(agent_topic(summary["agent_id"]), nudge_frame(), droppable=False)
    if summary["state"] == JobState.queued.value:  # resumed: an idle agent claims it now
        work_queued(tp)
    return summary


@router.post("/{job_id}/cancel")
async def cancel_job(job_id: int, tp: AppDep, caller: UserDep) -> JobSummary:
    """Queued: cancelled at once. Running: the agent stops the training process (SIGTERM, then
    SIGKILL after a grace period) and the job ends cancelled."""
    return await request_action(tp, job_id, "cancel", caller)


@router.post("/{job_id}/pause")
async def pause_job(job_id: int, tp: AppDep, caller: UserDep) -> JobSummary:
    return await request_action(tp, job_id, "pause", caller)


@router.post("/{job_id}/resume")
async def resume_job(job_id: int, tp: AppDep, caller: UserDep) -> JobSummary:
    """A paused job goes back to the queue. A command job's resume starts its command again: it
    needs the commands scope."""
    return await request_action(tp, job_id, "resume", caller)


@router.post("/{job_id}/stack")
async def capture_stack(job_id: int, tp: AppDep, caller: UserDep) -> JobSummary:
    """Ask the agent to dump every thread's stack of the training process into the job's log."""
    return await request_action(tp, job_id, "stack", caller)


@router.post("/{job_id}/clone", status_code=201)
async def clone_job(job_id: int, body: CloneRequest, tp: AppDep, caller: UserDep) -> Submitted:
    """Retry or clone: a new job with the same spec (and any changes), linked to its parent. A command
    job's clone runs code again: it needs a token with the `commands` scope, as a submit does."""
    with tp.db.read() as s:
        parent = get_job_or_404(s, job_id)
        check_owner(caller, parent, "clone")
        base, kind = json.loads(parent.spec), parent.kind
    if kind == EXTERNAL:
        raise HTTPException(409, f"job {job_id} is an external script (started by hand, not by an agent): "
                                 "there is no spec to run again")
    if kind == COMMAND:
        require_command_rights(caller, "clone a command job (it runs the command again)")
    base.update(body.changes)
    try:
        spec = JOB_KINDS[kind].model_validate(base)
    except ValidationError as e:  # the edited settings are a body error (422), like a submit's
        raise unprocessable(error_list(e.errors(), default_field="changes")) from None
    return await submit(tp, spec, caller, parent_id=job_id)


@router.get("/{job_id}/metrics", response_model=MetricsOut)
def get_metrics(job_id: int, tp: AppDep, _: UserDep,
                keys: Optional[list[str]] = Query(None, description="metric names (default: all)"),
                prefix: Optional[str] = Query(None, max_length=64, description="only names starting with this "
                                              "(sys/: the system metrics)"),
                max_points: int = Query(1000, ge=2, le=1_000_000, description="downsample above this"),
                after_step: Optional[int] = Query(None, description="only points after this step"),
                before_step: Optional[int] = Query(None, description="only points up to this step (zoom)"),
                mode: Literal["minmax", "lttb"] = "minmax",
                attempt: Optional[int] = Query(None, ge=0, le=2**62, description=(
                    "whose run: each attempt (a retry, a relaunch after a fix) keeps its own points; "
                    "default: the job's current attempt"))) -> Response:
    """Series by metric name: {"loss": {"step": [...], "value": [...], "t": [...]}}, as one attempt
    ran it (`attempt` in the answer): its own points, and before its first step those of the attempt
    it resumed from (a fresh start from step 0: its own alone). Long series are downsampled
    server-side, keeping each bucket's first, last, min and max points."""
    with tp.db.read() as s:
        job = get_job_or_404(s, job_id)
        if attempt is None:
            attempt = job.attempt
        # this job's own names only (never every job's: a read proportional to what is shown)
        if keys:
            names = dict(s.execute(select(MetricKey.name, MetricKey.id).where(MetricKey.name.in_(keys))).all())
        else:
            names = dict(s.execute(select(MetricKey.name, MetricKey.id).where(MetricKey.id.in_(
                select(MetricRollup.key_id).where(MetricRollup.job_id == job_id).distinct()))).all())
        wanted = keys or sorted((n for n in names if prefix is None or n.startswith(prefix)), key=names.__getitem__)
        out: dict = {}
        cur = raw_cursor(s)  # the DBAPI cursor: no per-row SQLAlchemy work
        for name in wanted:
            kid = names.get(name)
            if kid is None:
                continue
            series = read_run(cur, job_id, kid, attempt, max_points, mode, after_step, before_step,
                              by_time=name.startswith("sys/"))
            if series is not None:
                out[name] = series
    # orjson straight to bytes: FastAPI's jsonable_encoder walks every number (~0.3 s for 100k points).
    return Response(orjson.dumps({"job_id": job_id, "attempt": attempt, "series": out}), media_type="application/json")


@router.get("/{job_id}/events")
def get_events(job_id: int, tp: AppDep, _: UserDep,
               after_seq: int = Query(-1, ge=-1), kinds: Optional[list[str]] = Query(None),
               limit: int = Query(1000, ge=1, le=100_000), tail: bool = False) -> EventsOut:
    """Stored events (all but metrics), oldest first; tail=true gives the newest `limit` instead."""
    with tp.db.read() as s:
        get_job_or_404(s, job_id)
        where = [EventRow.job_id == job_id, EventRow.seq > after_seq]
        if kinds:
            where.append(EventRow.kind.in_(kinds))
        order = EventRow.seq.desc() if tail else EventRow.seq
        rows = list(s.scalars(select(EventRow).where(*where).order_by(order).limit(limit)))
        if tail:
            rows.reverse()
        return {"job_id": job_id, "events": [{"seq": r.seq, "t": r.t, "kind": r.kind,
                                              "data": json.loads(r.data)} for r in rows]}
