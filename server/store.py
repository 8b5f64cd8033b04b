"""The job state machine: creation, atomic claims, guarded transitions, retry policy.

Every function takes a Session inside a transaction (the writer's, see db.Database.write); none
commits on its own, so a caller's change is all or nothing.
"""
from __future__ import annotations

import json
import time
from typing import Optional, Union

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from server import ranks
from server.models import NEW_ATTEMPT_STEP, Agent, Alert, Attempt, Job, JobChange
from tokenpulse.protocol import (
    ACTIVE_STATES,
    COMMAND,
    EXTERNAL,
    FINAL_STATES,
    TRAIN,
    CommandSpec,
    Failure,
    JobSpec,
    JobState,
    load_spec,
    spec_kind,
)

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

# Failure policy. Worth another attempt (resuming from the newest checkpoint): a crash, a killed
# process, a lost worker, a stall the agent gave up on; out of memory too, with half the micro-batch.
RETRYABLE = {Failure.OOM, Failure.CRASH, Failure.LOST, Failure.SIGNAL, Failure.HANG, Failure.COLLECTIVE_TIMEOUT}
# Never retried, whatever the agent asks: a bad spec or a non-finite loss would only fail again; so
# would a full disk (disk_full: the same agent, the same output dir), and each retry would first
# write more onto it. The reason names the disk and the newest checkpoint kept: free space, then
# clone the job or resume from there.
FINAL_FAILURES = {Failure.SPEC, Failure.NAN, Failure.DISK_FULL, Failure.DATA}
# Why a failure of each final class is not retried (the attempt's `decision`).
NOT_RETRIED: dict[str, str] = {
    Failure.SPEC: "the spec cannot run as it is: fix the named field and clone the job",
    Failure.NAN: "a non-finite loss comes back at the same step with the same data and settings",
    Failure.DISK_FULL: "the same disk would fill again: free space, then resume or clone",
    Failure.DATA: "a data error naming its row fails on the same row again: fix the data",
    Failure.ERROR: "the command's own failure (a non-zero exit): it would fail the same way",
}


class TransitionError(Exception):
    """A state change the rules refuse; the API answers 409 with this message (server/errors.py)."""


def create_job(s: Session, spec: Union[JobSpec, CommandSpec], parent_id: Optional[int] = None,
               owner: Optional[int] = None) -> Job:
    """owner: the submitting token's principal (server/security.py Caller.principal_id)."""
    command = isinstance(spec, CommandSpec)
    if isinstance(spec, CommandSpec):
        name, total_steps = spec.name or spec.label(), None
    else:
        name, total_steps = spec.name or "", spec.max_steps
    job = Job(name=name, state=JobState.queued.value, kind=spec_kind(spec), spec=spec.model_dump_json(),
              priority=spec.priority, parent_id=parent_id, created_at=time.time(), attempt=0, next_seq=0,
              total_steps=total_steps, nnodes=spec.nnodes, owner_token_id=owner)
    s.add(job)
    s.flush()
    if not job.name:
        job.name = f"job-{job.id}"
    if command and not s.scalar(select(func.count()).select_from(Agent).where(
            Agent.state == "online", Agent.accepts_commands.is_(True))):
        job.reason = ("waiting for an agent that takes command jobs (one started with --allow-commands, "
                      "as the embedded worker of `tokenpulse up` is); none is online")
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
        job.requested_action = job.stack_requested_at = None
        job.agent_id = None
    if new in FINAL_STATES:
        job.finished_at = now
        # A job that is over has no live problem any more: clear its open alerts. A failed job keeps
        # its critical ones (the NaN naming its step, the lost worker, the stall): they say why.
        where = [Alert.job_id == job.id, Alert.state != "cleared"]
        if new == JobState.failed:
            where.append(Alert.severity != "critical")
        s.execute(update(Alert).where(*where).values(state="cleared", cleared_at=now, updated_at=now))


# ---- what a person asks for -------------------------------------------------------------------
# A queued or paused job changes state at once; a running one gets a requested action that the
# agent reads from its next heartbeat or event reply (and the job ends through end_attempt).
# A requested cancel wins: a later pause is refused, and a stack request (a look, not a change of
# course) has its own column, so no request ever overwrites another.

def request_cancel(s: Session, job: Job) -> None:
    state = JobState(job.state)
    if state in (JobState.queued, JobState.paused):
        transition(s, job, JobState.cancelled, reason="cancelled by user")
    elif state in ACTIVE_STATES:
        job.requested_action = "cancel"
    else:
        raise TransitionError(f"job {job.id} is {state.value}; only queued, paused or running jobs can be cancelled")


def _no_agent_runs_it(job: Job, action: str) -> None:
    if job.kind == EXTERNAL:  # server/external.py: a script started by hand
        raise TransitionError(f"job {job.id} is an external script (started by hand, not by an agent): "
                              f"tokenpulse cannot {action} it; cancel stops it")


def request_pause(s: Session, job: Job) -> None:
    _no_agent_runs_it(job, "pause")
    if JobState(job.state) not in ACTIVE_STATES:
        raise TransitionError(f"job {job.id} is {job.state}; only a running job can be paused")
    if job.requested_action == "cancel":
        raise TransitionError(f"job {job.id} is being cancelled; a cancel wins over a later pause")
    if job.kind == COMMAND and not (json.loads(job.info) if job.info else {}).get("pausable"):
        raise TransitionError(f"job {job.id} is a command job whose process cannot pause: pause needs a "
                              "checkpoint to resume from, which tokenpulse takes for Hugging Face Trainer "
                              "scripts it instruments (the job reports pausable once its Trainer starts). "
                              "Cancel it instead, or let it finish")
    job.requested_action = "pause"


def request_resume(s: Session, job: Job) -> None:
    _no_agent_runs_it(job, "resume")
    if JobState(job.state) != JobState.paused:
        raise TransitionError(f"job {job.id} is {job.state}; only a paused job can be resumed")
    transition(s, job, JobState.queued, reason="resumed by user")


def request_stack(s: Session, job: Job) -> None:
    """Ask the agent for every thread's stack of the training process (one-shot, see pending_commands)."""
    if JobState(job.state) not in ACTIVE_STATES:
        raise TransitionError(f"job {job.id} is {job.state}; it has no process to inspect")
    job.stack_requested_at = time.time()


REQUESTS = {"cancel": request_cancel, "pause": request_pause, "resume": request_resume, "stack": request_stack}


def claim(s: Session, agent_id: int, whole_gangs: bool = False) -> Optional[Job]:
    """Give the agent the best queued job, atomically: the UPDATE only matches a row still queued,
    so two agents can never both win it (one server's writer thread serializes its claims besides;
    several server processes on PostgreSQL skip each other's locked rows). A job whose
    stored spec no longer validates (written by an older version, say) fails with the reason and
    the next one is handed out: one bad row must never stall the queue.
    whole_gangs: a Slurm executor, which runs a multi-node job's nodes itself, takes those too."""
    agent = s.get(Agent, agent_id)
    if agent is None:
        return None
    running = s.scalar(select(func.count()).select_from(Job).where(
        Job.agent_id == agent_id, Job.state.in_([x.value for x in ACTIVE_STATES]))) or 0
    if running >= agent.capacity:
        return None
    # Command jobs run code: only agents started with --allow-commands are handed them.
    kinds = [TRAIN, COMMAND] if agent.accepts_commands else [TRAIN]
    while True:
        # (multi-node jobs are claimed by a gang of agents together: server/gang.py)
        # FOR UPDATE SKIP LOCKED (PostgreSQL; SQLite has no row locks and ignores it): another server
        # process claiming at this moment takes the next job instead of waiting for this one.
        candidate = (select(Job.id).where(Job.state == JobState.queued.value, Job.kind.in_(kinds),
                                  Job.nnodes >= 1 if whole_gangs else Job.nnodes == 1)
                     .order_by(Job.priority.desc(), Job.id).limit(1)
                     .with_for_update(skip_locked=True).scalar_subquery())
        job_id = s.execute(update(Job).where(Job.id == candidate, Job.state == JobState.queued.value)
                           .values(state=JobState.starting.value, agent_id=agent_id,
                                   attempt=Job.attempt + 1, alive_at=time.time(), reason=None,
                                   last=None, phase=None, step=NEW_ATTEMPT_STEP)  # the new attempt's own
                           .returning(Job.id)).scalar()
        if job_id is None:
            return None
        job = s.get(Job, job_id)
        assert job is not None  # the row this transaction has just claimed
        s.refresh(job)
        attempt = Attempt(job_id=job.id, attempt=job.attempt, agent_id=agent_id, started_at=time.time(),
                          resumed_from=job.checkpoint)
        s.add(attempt)
        problem = unusable_spec(job)
        if problem is None:
            return job
        job.failure = attempt.failure = Failure.SPEC
        _final(s, job, JobState.failed, f"the stored job spec is not valid ({problem}); clone the job "
               "and fix the named field", attempt, time.time())


def unusable_spec(job: Job) -> Optional[str]:
    """Why a stored spec cannot be run, or None."""
    try:
        load_spec(job.kind, job.spec)
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        return "; ".join(f"{'.'.join(map(str, x['loc'])) or 'spec'}: {x['msg']}" for x in e.errors()) \
            if hasattr(e, "errors") else str(e)
    return None


def reconcile(s: Session, agent_id: int, reported: set[int], lease_s: float, since: float,
              held: Optional[list[Job]] = None, delivered=None) -> list[Job]:
    """A heartbeat lists the jobs the agent runs. A job the server holds as the agent's but that the
    agent has not reported for a whole lease (a claim whose answer was lost in flight, an agent
    restarted under the same id) is as lost as a silent agent's: the retry policy takes it. Never
    within a lease of the server's own start (agents are still replaying what they journaled).
    held: the agent's active jobs when the caller loaded them already (many agents in one query).
    delivered: when the agent last sent each job's events (ingest.heartbeats.Deliveries): a job whose
    backlog is still arriving is not lost, whatever its heartbeats say (its end may be in that backlog)."""
    now = time.time()
    if now - since < lease_s:
        return []
    out = []
    if held is None:
        held = list(s.scalars(select(Job).where(Job.agent_id == agent_id,
                                                Job.state.in_([x.value for x in ACTIVE_STATES]))))
    for job in held:
        if job.id in reported or now - (job.alive_at or 0) < lease_s:
            continue
        if delivered is not None and now - delivered.get(job.id, 0.0) < lease_s:
            continue
        end_attempt(s, job, JobState.failed, f"agent {agent_id} is alive but does not run this job "
                    f"(not in its heartbeats for {now - (job.alive_at or 0):.0f} s; a lost claim answer?)",
                    Failure.LOST)
        out.append(job)
    return out


def retries_used(s: Session, job: Job) -> int:
    """Attempts of this job that failed and were retried (pauses and resumes do not count)."""
    return s.scalar(select(func.count()).select_from(Attempt).where(
        Attempt.job_id == job.id, Attempt.outcome == "retried")) or 0


def end_attempt(s: Session, job: Job, state: JobState, reason: Optional[str], failure: Optional[str],
                exit_code: Optional[int] = None, signal: Optional[str] = None,
                retry: bool = False, rank_exits: Optional[dict] = None, lost_agent: Optional[int] = None,
                step: Optional[int] = None, frame: Optional[str] = None, peak_mb: Optional[float] = None) -> JobState:
    """Apply how an attempt ended, with the failure policy: the failure is classed and the retry
    chosen to cure it.

    - oom: requeued with half the micro-batch and twice the accumulation (same effective batch),
      from step 0 (a checkpoint's data position belongs to its micro-batch layout); at micro-batch 1,
      or with the budget spent, it gives up naming the peak memory the attempt reached;
    - crash, killed, lost worker, a collective's timeout: requeued, resuming from the newest checkpoint;
    - hang (a stall the agent killed after stall.kill_after_s): retried from the newest checkpoint; a
      hang at the same step in the same frame as an earlier attempt's is deterministic: not retried;
    - preempted (a SIGTERM from outside; the process checkpointed): requeued, no retry spent;
    - spec, nan, disk_full, data (an error naming its row), a command's own error: final at once;
    - each job retries at most spec.max_retries times; a cancel asked for wins over any retry.
    The attempt row keeps why it ended (outcome, failure and its class, exit code, signal, reason),
    the change made for the next attempt and why the next was (not) made (`decision`)."""
    if JobState(job.state) not in ACTIVE_STATES:
        return JobState(job.state)  # already settled (a late report after a lease expired)
    ranks.settle(s, job, state.value, rank_exits, lost_agent)  # the rank table's exit column
    job.failure, job.exit_code, job.signal = failure, exit_code, signal
    now = time.time()
    attempt = s.get(Attempt, (job.id, job.attempt))
    if attempt is not None:
        attempt.failure, attempt.exit_code, attempt.signal = failure, exit_code, signal
        attempt.failure_class, attempt.peak_mb = failure, peak_mb
        if failure == Failure.HANG:
            attempt.hang_step, attempt.hang_frame = step, frame
    if job.requested_action == "cancel" and state in (JobState.failed, JobState.paused, JobState.queued):
        state, reason = JobState.cancelled, f"cancelled by user ({reason})" if reason else "cancelled by user"
        return _final(s, job, state, reason, attempt, now, "cancelled by user: no further attempt")
    relaunched = settle_change(s, job, state, attempt, now)  # a fix's pause ends in its relaunch
    if relaunched is not None:
        return relaunched
    if state == JobState.queued:  # checkpointed and back to the queue, no retry spent
        where = f"resumes from checkpoint {job.checkpoint}" if job.checkpoint else "starts again from step 0"
        if failure == Failure.PREEMPTED:
            if job.requested_action == "pause":  # a person asked for a pause meanwhile: it pauses there
                return _final(s, job, JobState.paused, reason, attempt, now, f"paused as asked; {where} on resume")
            requeued = (f"requeued: preempted (a SIGTERM not sent by its agent, or the scheduler's preemption); "
                        f"{where}; a preemption is not the job's fault: no retry spent")
        else:
            requeued = f"requeued (its agent stopped or could not run it here); {where}; no retry spent"
        transition(s, job, JobState.queued, reason=reason)
        if attempt is not None:
            attempt.ended_at, attempt.reason, attempt.decision = now, reason, requeued
            attempt.outcome = "preempted" if failure == Failure.PREEMPTED else "queued"
        return JobState.queued
    if state == JobState.failed and failure not in FINAL_FAILURES and (retry or failure in RETRYABLE):
        spec = load_spec(job.kind, job.spec)
        used = retries_used(s, job)
        memory = f"; peak memory {peak_mb:,.0f} MiB" if peak_mb else ""
        if failure == Failure.HANG and step is not None and frame:
            same = s.scalars(select(Attempt).where(
                Attempt.job_id == job.id, Attempt.attempt < job.attempt, Attempt.failure == Failure.HANG,
                Attempt.hang_step == step, Attempt.hang_frame == frame).order_by(Attempt.attempt)).first()
            if same is not None:
                why = (f"deterministic hang: attempt {same.attempt} hung at the same step {step} in the same "
                       f"frame {frame}; not retried (it would hang there again)")
                return _final(s, job, state, f"{reason}; {why}", attempt, now, f"not retried: {why}")
        if used < spec.max_retries:
            note, change = "", None
            if failure == Failure.OOM and isinstance(spec, JobSpec):
                smaller = halve_micro_batch(spec, json.loads(job.info) if job.info else {})
                if smaller is None:
                    why = f"out of memory at micro-batch 1: nothing left to halve{memory}"
                    return _final(s, job, state, f"{reason}; {why}", attempt, now, f"not retried: {why}")
                old_bs, old_ga = _sizes(spec, json.loads(job.info) if job.info else {})
                change = {"batch_size": [old_bs, smaller.batch_size], "grad_accum": [old_ga, smaller.grad_accum]}
                spec = smaller
                job.spec = spec.model_dump_json()
                job.checkpoint = None
                note = f"; retrying with batch_size={spec.batch_size}, grad_accum={spec.grad_accum} from step 0"
            elif job.checkpoint:
                note = f"; retrying from checkpoint {job.checkpoint}"
            elif isinstance(spec, CommandSpec):
                note = "; running the command again"
            else:
                note = "; retrying from step 0 (no checkpoint yet)"
            why = f"attempt {job.attempt} failed ({failure or 'error'}): {reason or 'no reason given'}"
            budget = f"retry {used + 1} of {spec.max_retries}"
            transition(s, job, JobState.queued, reason=f"{why}{note} ({budget})")
            if attempt is not None:  # after transition(), which marks it 'queued'
                attempt.ended_at, attempt.outcome, attempt.reason = now, "retried", why[:8000]
                attempt.change = json.dumps(change) if change else None
                attempt.decision = f"{budget}: {CURES.get(str(failure), 'retried')}{note}"
            return JobState.queued
        given_up = f"gave up after {used} retr{'y' if used == 1 else 'ies'} (max_retries={spec.max_retries})"
        reason = f"{reason}; {given_up}{memory}"
        return _final(s, job, state, reason, attempt, now, f"not retried: {given_up}{memory}")
    decision = None
    if state == JobState.failed:
        decision = f"not retried: {NOT_RETRIED.get(str(failure), 'the agent did not ask for a retry')}"
    return _final(s, job, state, reason, attempt, now, decision)


# What each retried class's retry is meant to cure (the attempt's `decision`).
CURES: dict[str, str] = {
    Failure.OOM: "out of memory, half the micro-batch and twice the accumulation",
    Failure.CRASH: "a crash, again from the newest checkpoint",
    Failure.SIGNAL: "killed by a signal, again from the newest checkpoint",
    Failure.LOST: "a lost worker, again from the newest checkpoint on any agent",
    Failure.HANG: "a hang, again from the newest checkpoint (the same hang again is not retried)",
    Failure.COLLECTIVE_TIMEOUT: "a collective's timeout (transient), again from the newest checkpoint",
}


def _sizes(spec: JobSpec, info: dict) -> tuple[int, int]:
    """The micro-batch and accumulation an attempt ran with ('auto' read from what it chose)."""
    bs = spec.batch_size if isinstance(spec.batch_size, int) else info.get("batch_size", 8)
    ga = spec.grad_accum if isinstance(spec.grad_accum, int) else info.get("grad_accum", 1)
    return int(bs), int(ga)


def settle_change(s: Session, job: Job, state: JobState, attempt: Optional[Attempt], now: float
                  ) -> Optional[JobState]:
    """A fix asked for (server/fixes.py: a job_changes row 'pending', a pause requested) and the attempt
    ended: paused (or requeued by its agent's stop) with its checkpoint saved -> the spec changed and the
    job queued at once, to resume from that checkpoint, or from step 0 where the change makes it
    unusable (the fix says so). Any other end drops the change. None: no fix was pending."""
    change = s.scalar(select(JobChange).where(JobChange.job_id == job.id, JobChange.state == "pending"))
    if change is None:
        return None
    if state not in (JobState.paused, JobState.queued):
        change.state = "dropped"
        change.verdict = json.dumps({"verdict": f"not applied: the attempt ended {state.value} before its checkpoint"})
        return None
    fix = json.loads(change.fix)
    job.spec = fix["spec_after"]
    fresh = change.resume == "fresh"
    if fresh:
        job.checkpoint, job.step = None, 0  # the new attempt starts again from step 0
    change.state, change.applied_at, change.from_attempt = "applied", now, job.attempt
    change.to_attempt, change.resume_step = job.attempt + 1, 0 if fresh else (job.step or 0)
    where = "from step 0 (" + fix.get("why_fresh", "the checkpoint does not fit the change") + ")" if fresh else \
        f"from checkpoint {job.checkpoint}" if job.checkpoint else "from step 0 (no checkpoint)"
    transition(s, job, JobState.queued, reason=f"fix applied: {fix.get('title') or change.kind}; relaunching {where}")
    source = s.get(Alert, change.alert_id) if change.alert_id else None
    if source is not None and source.state != "cleared":  # its verdict was about the old settings
        source.state, source.cleared_at, source.updated_at = "cleared", now, now
        source.message = f"{source.message}\nCleared: fix #{change.id} applied; the new attempt is judged afresh"
    if attempt is not None:  # after transition(), which marks it 'queued'
        attempt.ended_at, attempt.outcome = now, "changed"
        attempt.change = json.dumps(fix.get("changes") or {}) or None
        attempt.decision = f"fix #{change.id} applied ({fix.get('title') or change.kind}): relaunched {where}"
    return JobState.queued


def _final(s: Session, job: Job, state: JobState, reason: Optional[str], attempt: Optional[Attempt],
           now: float, decision: Optional[str] = None) -> JobState:
    transition(s, job, state, reason=reason)
    if attempt is not None:  # transition() wrote outcome/reason; keep them (and the end time)
        attempt.ended_at, attempt.outcome, attempt.reason = now, state.value, reason
        attempt.decision = decision
    return state


def halve_micro_batch(spec: JobSpec, info: Optional[dict] = None) -> Optional[JobSpec]:
    """Out of memory: half the micro-batch, double accumulation, same effective batch. 'auto' sizes
    are read from what the attempt chose (its info events); None when the micro-batch is already 1."""
    bs, ga = _sizes(spec, info or {})
    if bs <= 1:
        return None
    return spec.model_copy(update={"batch_size": max(1, bs // 2), "grad_accum": min(65536, ga * 2)})


def job_summary(job: Job) -> dict:
    """The row a jobs list and a websocket 'job' frame carry."""
    return {
        "id": job.id, "name": job.name, "kind": job.kind, "state": job.state, "priority": job.priority,
        "parent_id": job.parent_id, "created_at": job.created_at, "started_at": job.started_at,
        "finished_at": job.finished_at, "agent_id": job.agent_id, "attempt": job.attempt,
        "phase": json.loads(job.phase) if job.phase else None, "step": job.step,
        "total_steps": job.total_steps, "last": json.loads(job.last) if job.last else {},
        "alive_at": job.alive_at, "reason": job.reason, "failure": job.failure,
        "exit_code": job.exit_code, "signal": job.signal, "requested_action": job.requested_action,
        "stack_requested": job.stack_requested_at is not None,
        "checkpoint": job.checkpoint, "output_dir": job.output_dir, "owner": job.owner_token_id,
    }
