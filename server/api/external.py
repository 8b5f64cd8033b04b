"""External jobs (server/external.py): created by a script's watchdog, reported like an agent's."""
from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from server import auth, external, store
from server.agent_protocol import after_ingest
from server.context import AppDep
from server.errors import invalid_body
from server.ingest import apply, parse
from server.models import Job
from server.security import UserDep, token_from
from tokenpulse.protocol import JOBS_TOPIC, AgentReply, heartbeat_frame, job_frame, job_topic

router = APIRouter(prefix="/api/jobs", tags=["external jobs"])


@router.post("/external", status_code=201)
async def create_external(run: external.ExternalRun, tp: AppDep, caller: UserDep) -> dict:
    """A script started by hand (tokenpulse.init with TOKENPULSE_URL) gets a job, the URL to send
    its event batches to (the agents' batch shape, seq from 0) and `report_token`, the job's own
    credential for them (shown this once): only it, or an admin, may post the job's events."""
    report_token = external.new_report_token()

    def create(s):
        job = external.create(s, run, caller.principal_id, report_token)
        return store.job_summary(job)
    summary = await tp.db.write(create)
    tp.hub.publish(JOBS_TOPIC, job_frame(summary), droppable=False)
    return {"id": summary["id"], "job": summary, "events_url": f"/api/jobs/{summary['id']}/events",
            "next_seq": 0, "report_token": report_token}


def may_report(tp, job, secret: str) -> None:
    """The job's own credential, or an admin token; anything else may not write into the job."""
    if secret and job.report_hash is not None and auth.hash_token(secret) == job.report_hash:
        return
    caller = tp.caller(secret) if secret else None
    if caller is not None and caller.is_admin:
        return
    if caller is None:
        raise HTTPException(401, f"missing or invalid credential: send job {job.id}'s report token (returned by "
                                 "the call that created it) as 'Authorization: Bearer <token>'")
    raise HTTPException(403, f"events refused: job {job.id}'s events may be posted only with its own report token "
                             "(returned once by the call that created it) or by an admin")


@router.post("/{job_id}/events", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"type": "object", "required": ["events"],
                                    "properties": {"events": {"type": "array", "items": {"type": "object"}}}}}}}})
async def report_external(job_id: int, request: Request, tp: AppDep) -> AgentReply:
    """Store an external job's batch ({"events": [...]}, every event for this job); answer with the
    highest stored seq and any command (cancel, stack) for the script's watchdog. Authorized by the
    job's report token (from its creation) or an admin token."""
    secret = token_from(request.headers, {}, {})  # bearer only: a browser cookie never posts events
    with tp.db.read() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise HTTPException(404, f"job {job_id} does not exist")
        if external.is_external(job):
            may_report(tp, job, secret)
        elif tp.caller(secret) is None:
            raise HTTPException(401, "missing or invalid token")
    body = await request.body()

    def store_batch(s):
        job = s.get(Job, job_id)
        if job is None:
            raise HTTPException(404, f"job {job_id} does not exist")
        if not external.is_external(job):
            raise HTTPException(409, f"job {job_id} is run by an agent; only external jobs take events here")
        events = parse.parse_batch(body)
        for i, e in enumerate(events):
            if e.job_id != job_id:
                raise invalid_body(("events", i, "job_id"), f"must be {job_id}, the job in the URL")
        events, alive_at = external.split_alive(events)
        frames = []
        if alive_at is not None and job.agent_id is None:
            job.alive_at = max(job.alive_at or 0, alive_at)
            beat = heartbeat_frame(job_id, alive_at, alive_at)
            frames += [(job_topic(job_id), beat, True), (JOBS_TOPIC, beat, True)]
        out = apply.ingest(s, None, events, tp.hub)
        out.frames.extend(frames)
        out.commands = external.commands_for(job)
        return out
    out = await tp.db.write(store_batch, bulk=len(body) > 65536)
    after_ingest(tp, out)
    return AgentReply(acked=out.acked, commands=out.commands)
