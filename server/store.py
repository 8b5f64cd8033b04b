"""The job state machine: creation, atomic claims, guarded transitions, retry policy.

Every function takes a Session inside a transaction (the writer's, see db.Database.write); none
commits on its own, so a caller's change is all or nothing.
"""
from __future__ import annotations

import json
import time
from typing import Callable, Optional, Union

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from server import ranks
from server.attempt_outcomes import CURES, Ending, Next, Outcome, choose, sizes
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

class TransitionError(Exception):
    """A state change the rules refuse; the API answers 409 with this message (server/errors.py)."""


def create_job(s: Session, spec: Union[JobSpec, CommandSpec], parent_id: Optional[int] = None,
               owner: Optional[int] = None, sweep_id: Optional[int] = None) -> Job:
    """owner: the submitting token's principal (server/security.py Caller.principal_id); sweep_id:
    the sweep it is a trial of."""
    command = isinstance(spec, CommandSpec)
    if isinstance(spec, CommandSpec):
        name, total_steps = spec.name or spec.label(), None
    else:
        name, total_steps = spec.name or "", spec.max_steps
    job = Job(name=name, state=JobState.queued.value, kind=spec_kind(spec), spec=spec.model_dump_json(),
              priority=spec.priority, parent_id=parent_id, created_at=time.time(), attempt=0, next_seq=0,
              total_steps=total_steps, nnodes=spec.nnodes, owner_token_id=owner, project=spec.project,
              tags=json.dumps(list(dict.fromkeys(spec.tags))), sweep_id=sweep_id)
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


def end_attempt(s: Session, job: Job, state: JobState, reason: Optional[str], failure: Optional[str],
                exit_code: Optional[int] = None, signal: Optional[str] = None,
                retry: bool = False, rank_exits: Optional[dict] = None, lost_agent: Optional[int] = None,
                step: Optional[int] = None, frame: Optional[str] = None, peak_mb: Optional[float] = None) -> JobState:
    """Apply how an attempt ended, with the failure policy: the ending is classed by the first row of
    attempt_outcomes.OUTCOMES that matches it (a cancel asked for, a fix's pause, a preemption, an
    agent's stop, a final class, a deterministic hang, a spent budget, an OOM, a retryable failure...)
    and that row's `Next` carried out here (`_NEXT`). Each job retries at most spec.max_retries times.
    The attempt row keeps why it ended (outcome, failure and its class, exit code, signal, reason),
    the change made for the next attempt and why the next was (not) made (`decision`)."""
    if JobState(job.state) not in ACTIVE_STATES:
        return JobState(job.state)  # already settled (a late report after a lease expired)
    ranks.settle(s, job, state.value, rank_exits, lost_agent)  # the rank table's exit column
    job.failure, job.exit_code, job.signal = failure, exit_code, signal
    attempt = s.get(Attempt, (job.id, job.attempt))
    if attempt is not None:
        attempt.failure, attempt.exit_code, attempt.signal = failure, exit_code, signal
        attempt.failure_class, attempt.peak_mb = failure, peak_mb
        if failure == Failure.HANG:
            attempt.hang_step, attempt.hang_frame = step, frame
    e = Ending(s, job, state, reason, failure, retry, attempt, time.time(), step, frame, peak_mb)
    row = choose(e)
    if row.next not in (Next.CANCEL, Next.RELAUNCH) and e.change is not None:
        _drop_change(e.change, state)  # the attempt ended before the fix's checkpoint
    return _NEXT[row.next](e, row)


def _drop_change(change: JobChange, state: JobState) -> None:
    change.state = "dropped"
    change.verdict = json.dumps({"verdict": f"not applied: the attempt ended {state.value} before its checkpoint"})


def _ended(e: Ending, row: Outcome) -> JobState:
    """The job ends: cancelled, paused, failed (past a limit) or in the state reported."""
    ends = {Next.CANCEL: JobState.cancelled, Next.PAUSE: JobState.paused, Next.FAIL: JobState.failed}
    state = ends.get(row.next, e.state)
    reason = row.reason(e) if row.reason else e.reason
    return _final(e.s, e.job, state, reason, e.attempt, e.now, row.decision(e))


def _relaunch(e: Ending, row: Outcome) -> JobState:
    relaunched = settle_change(e.s, e.job, e.state, e.attempt, e.now)
    assert relaunched is not None  # the row matched a pending change
    return relaunched


def _requeue(e: Ending, row: Outcome) -> JobState:
    """Checkpointed and back to the queue, no retry spent."""
    transition(e.s, e.job, JobState.queued, reason=e.reason)
    if e.attempt is not None:
        e.attempt.ended_at, e.attempt.reason, e.attempt.decision = e.now, e.reason, row.decision(e)
        e.attempt.outcome = row.outcome
    return JobState.queued


def _retry(e: Ending, row: Outcome) -> JobState:
    """Back to the queue with a retry spent: from the newest checkpoint, or (OOM) with half the
    micro-batch and twice the accumulation from step 0 (a checkpoint's data position belongs to its
    micro-batch layout)."""
    job, spec, change = e.job, e.spec, None
    if row.next == Next.RETRY_SMALLER:
        smaller = e.smaller
        assert isinstance(spec, JobSpec) and smaller is not None  # the row before it takes micro-batch 1
        old_bs, old_ga = sizes(spec, e.info)
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
    why = f"attempt {job.attempt} failed ({e.failure or 'error'}): {e.reason or 'no reason given'}"
    budget = f"retry {e.used + 1} of {spec.max_retries}"
    transition(e.s, job, JobState.queued, reason=f"{why}{note} ({budget})")
    if e.attempt is not None:  # after transition(), which marks it 'queued'
        e.attempt.ended_at, e.attempt.outcome, e.attempt.reason = e.now, "retried", why[:8000]
        e.attempt.change = json.dumps(change) if change else None
        e.attempt.decision = f"{budget}: {CURES.get(str(e.failure), 'retried')}{note}"
    return JobState.queued


# What the store does for each row's Next.
_NEXT: dict[Next, Callable[[Ending, Outcome], JobState]] = {
    Next.CANCEL: _ended, Next.RELAUNCH: _relaunch, Next.PAUSE: _ended, Next.REQUEUE: _requeue,
    Next.RETRY: _retry, Next.RETRY_SMALLER: _retry, Next.FINAL: _ended, Next.FAIL: _ended,
}


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
        _drop_change(change, state)
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


# The latest values a jobs list and its live frames carry unasked: what lists show (the jobs page's
# fixed columns, the CLI, the compare page). A list asks for more by name (GET /api/jobs?columns=);
# a job's own page reads them all. A run with thousands of metric names must not make every list
# and every websocket frame carry each of them.
LISTED_LAST = ("step", "loss", "eval/loss", "eval/ppl", "lr", "tokens_per_s", "padded_tokens_per_s", "eta_s")


def latest(job: Job, names=LISTED_LAST) -> dict:
    """The job's latest values of these names (None: all of them)."""
    last = json.loads(job.last) if job.last else {}
    return last if names is None else {k: last[k] for k in names if k in last}


def job_summary(job: Job, last=LISTED_LAST) -> dict:
    """The row a jobs list and a websocket 'job' frame carry (last: the latest values of these names;
    None: every one)."""
    return {
        "id": job.id, "name": job.name, "kind": job.kind, "state": job.state, "priority": job.priority,
        "parent_id": job.parent_id, "created_at": job.created_at, "started_at": job.started_at,
        "finished_at": job.finished_at, "agent_id": job.agent_id, "attempt": job.attempt,
        "phase": json.loads(job.phase) if job.phase else None, "step": job.step,
        "total_steps": job.total_steps, "last": latest(job, last),
        "alive_at": job.alive_at, "reason": job.reason, "failure": job.failure,
        "exit_code": job.exit_code, "signal": job.signal, "requested_action": job.requested_action,
        "stack_requested": job.stack_requested_at is not None,
        "checkpoint": job.checkpoint, "output_dir": job.output_dir, "owner": job.owner_token_id,
        "project": job.project, "tags": json.loads(job.tags) if job.tags else [], "sweep_id": job.sweep_id,
    }
