"""The job state machine: creation, atomic claims, guarded transitions, retry policy.

Every function takes a Session inside a transaction (the writer's, see db.Database.write); none
commits on its own, so a caller's change is all or nothing.
"""
from __future__ import annotations

import json
import time
from typing import Optional

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from server.models import Agent, Alert, Attempt, Job
from tokenpulse.protocol import ACTIVE_STATES, FINAL_STATES, JobSpec, JobState

# Which transitions are legal. Anything else is refused (409), never silently applied.
TRANSITIONS: dict[JobState, set[JobState]] = {
    JobState.queued: {JobState.starting, JobState.cancelled},
    JobState.starting: {JobState.running, JobState.queued, JobState.completed, JobState.failed,
                        JobState.cancelled, JobState.paused},
    JobState.running: {JobState.queued, JobState.completed, JobState.failed, JobState.cancelled,
                       JobState.paused},
    JobState.paused: {JobState.queued, JobState.cancelled},
    JobState.completed: set(),
    JobState.failed: set(),
    JobState.cancelled: set(),
}

# Failures worth another attempt; a bad spec or a NaN loss would only fail again.
RETRYABLE = {"oom", "crash", "lost", "signal"}


class TransitionError(Exception):
    pass


def create_job(s: Session, spec: JobSpec, parent_id: Optional[int] = None) -> Job:
    job = Job(name=spec.name or "", state=JobState.queued.value, spec=spec.model_dump_json(),
              priority=spec.priority, parent_id=parent_id, created_at=time.time(), attempt=0,
              next_seq=0, total_steps=spec.max_steps)
    s.add(job)
    s.flush()
    if not job.name:
        job.name = f"job-{job.id}"
    return job


def transition(s: Session, job: Job, new: JobState, reason: Optional[str] = None) -> None:
    old = JobState(job.state)
    if new == old:
        return
    if new not in TRANSITIONS[old]:
        raise TransitionError(f"job {job.id} is {old.value}; it cannot become {new.value}")
    now = time.time()
    job.state = new.value
    if reason is not None:
        job.reason = reason
    if new == JobState.running and job.started_at is None:
        job.started_at = now
    if new in FINAL_STATES or new in (JobState.paused, JobState.queued):
        if old in ACTIVE_STATES:
            s.execute(update(Attempt).where(Attempt.job_id == job.id, Attempt.attempt == job.attempt)
                      .values(ended_at=now, outcome=new.value, reason=reason))
        job.requested_action = None
        job.agent_id = None
    if new in FINAL_STATES:
        job.finished_at = now
        # A job that is over has no live problem any more: clear its open alerts.
        s.execute(update(Alert).where(Alert.job_id == job.id, Alert.state != "cleared")
                  .values(state="cleared", cleared_at=now, updated_at=now))


def claim(s: Session, agent_id: int) -> Optional[Job]:
    """Give the agent the best queued job, atomically: the UPDATE only matches a row still queued,
    so two agents can never both win it (the writer thread serializes claims besides)."""
    agent = s.get(Agent, agent_id)
    if agent is None:
        return None
    running = s.scalar(select(func.count()).select_from(Job).where(
        Job.agent_id == agent_id, Job.state.in_([x.value for x in ACTIVE_STATES])))
    if running >= agent.capacity:
        return None
    candidate = (select(Job.id).where(Job.state == JobState.queued.value)
                 .order_by(Job.priority.desc(), Job.id).limit(1).scalar_subquery())
    job_id = s.execute(update(Job).where(Job.id == candidate, Job.state == JobState.queued.value)
                       .values(state=JobState.starting.value, agent_id=agent_id,
                               attempt=Job.attempt + 1, alive_at=time.time(), reason=None)
                       .returning(Job.id)).scalar()
    if job_id is None:
        return None
    job = s.get(Job, job_id)
    s.refresh(job)
    s.add(Attempt(job_id=job.id, attempt=job.attempt, agent_id=agent_id, started_at=time.time()))
    return job


def end_attempt(s: Session, job: Job, state: JobState, reason: Optional[str], failure: Optional[str],
                exit_code: Optional[int] = None, signal: Optional[str] = None,
                retry: bool = False) -> JobState:
    """Apply how an attempt ended, with the retry policy: a retryable failure with attempts left
    goes back to the queue (resuming from its newest checkpoint); anything else is final."""
    job.failure, job.exit_code, job.signal = failure, exit_code, signal
    if state == JobState.failed and (retry or failure in RETRYABLE):
        spec = JobSpec.model_validate_json(job.spec)
        if job.attempt <= spec.max_retries and job.requested_action != "cancel":
            if failure == "oom":
                spec = halve_micro_batch(spec)
                job.spec = spec.model_dump_json()
            transition(s, job, JobState.queued, reason=f"attempt {job.attempt} failed ({failure}): {reason}; retrying")
            return JobState.queued
    if job.requested_action == "cancel" and state == JobState.failed:
        state = JobState.cancelled
    transition(s, job, state, reason=reason)
    return state


def halve_micro_batch(spec: JobSpec) -> JobSpec:
    """Out of memory: half the micro-batch, double accumulation, same effective batch."""
    bs = spec.batch_size if isinstance(spec.batch_size, int) else 8
    ga = spec.grad_accum if isinstance(spec.grad_accum, int) else 1
    if bs <= 1:
        return spec
    return spec.model_copy(update={"batch_size": max(1, bs // 2), "grad_accum": ga * 2})


def job_summary(job: Job) -> dict:
    """The row a jobs list and a websocket 'job' frame carry."""
    return {
        "id": job.id, "name": job.name, "state": job.state, "priority": job.priority,
        "parent_id": job.parent_id, "created_at": job.created_at, "started_at": job.started_at,
        "finished_at": job.finished_at, "agent_id": job.agent_id, "attempt": job.attempt,
        "phase": json.loads(job.phase) if job.phase else None, "step": job.step,
        "total_steps": job.total_steps, "last": json.loads(job.last) if job.last else {},
        "alive_at": job.alive_at, "reason": job.reason, "failure": job.failure,
        "exit_code": job.exit_code, "signal": job.signal, "requested_action": job.requested_action,
        "checkpoint": job.checkpoint, "output_dir": job.output_dir,
    }
