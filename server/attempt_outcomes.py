"""How an attempt ended -> what happens next: the one table `store.end_attempt` walks.

Each row names an ending (a cancel asked for, a fix's pause, a preemption, an agent's stop, a failure
of some class...) and what follows it (`Next`). The first row whose `when` holds decides; the store
carries it out (server/store.py `_NEXT`). The facts a row looks at are read from the job, its
attempts and its pending change (`Ending`), each at most once and only when a row asks.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Optional, Union

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from server.models import Attempt, Job, JobChange
from tokenpulse.protocol import CommandSpec, Failure, JobSpec, JobState, load_spec

# Worth another attempt (resuming from the newest checkpoint): a crash, a killed process, a lost
# worker, a stall the agent gave up on, a collective's timeout; out of memory too, with half the
# micro-batch.
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
# What each retried class's retry is meant to cure (the attempt's `decision`).
CURES: dict[str, str] = {
    Failure.OOM: "out of memory, half the micro-batch and twice the accumulation",
    Failure.CRASH: "a crash, again from the newest checkpoint",
    Failure.SIGNAL: "killed by a signal, again from the newest checkpoint",
    Failure.LOST: "a lost worker, again from the newest checkpoint on any agent",
    Failure.HANG: "a hang, again from the newest checkpoint (the same hang again is not retried)",
    Failure.COLLECTIVE_TIMEOUT: "a collective's timeout (transient), again from the newest checkpoint",
}


# Times one job is requeued after a preemption (set from Settings.max_preemptions by create_app): one
# more fails it, so a job preempted forever ends, naming the cap and the setting that raises it.
MAX_PREEMPTIONS = 20


def retries_used(s: Session, job: Job) -> int:
    """Attempts of this job that failed and were retried (pauses and resumes do not count)."""
    return s.scalar(select(func.count()).select_from(Attempt).where(
        Attempt.job_id == job.id, Attempt.outcome == "retried")) or 0


def sizes(spec: JobSpec, info: dict) -> tuple[int, int]:
    """The micro-batch and accumulation an attempt ran with ('auto' read from what it chose)."""
    bs = spec.batch_size if isinstance(spec.batch_size, int) else info.get("batch_size", 8)
    ga = spec.grad_accum if isinstance(spec.grad_accum, int) else info.get("grad_accum", 1)
    return int(bs), int(ga)


def halve_micro_batch(spec: JobSpec, info: Optional[dict] = None) -> Optional[JobSpec]:
    """Out of memory: half the micro-batch, double accumulation, same effective batch. 'auto' sizes
    are read from what the attempt chose (its info events); None when the micro-batch is already 1."""
    bs, ga = sizes(spec, info or {})
    if bs <= 1:
        return None
    return spec.model_copy(update={"batch_size": max(1, bs // 2), "grad_accum": min(65536, ga * 2)})


@dataclass
class Ending:
    """How one attempt ended, as the agent (or the reaper) reported it, and the facts the rows read."""
    s: Session
    job: Job
    state: JobState
    reason: Optional[str]
    failure: Optional[str]
    retry: bool
    attempt: Optional[Attempt]
    now: float
    step: Optional[int] = None
    frame: Optional[str] = None
    peak_mb: Optional[float] = None
    asked: Optional[str] = field(init=False)  # what a person asked of the job: cancel, pause

    def __post_init__(self) -> None:
        self.asked = self.job.requested_action

    @cached_property
    def change(self) -> Optional[JobChange]:
        """A fix waiting for this attempt's end (server/fixes.py)."""
        return self.s.scalar(select(JobChange).where(JobChange.job_id == self.job.id, JobChange.state == "pending"))

    @cached_property
    def spec(self) -> Union[JobSpec, CommandSpec]:
        return load_spec(self.job.kind, self.job.spec)

    @cached_property
    def info(self) -> dict:
        return json.loads(self.job.info) if self.job.info else {}

    @cached_property
    def used(self) -> int:
        return retries_used(self.s, self.job)

    @cached_property
    def preemptions(self) -> int:
        """Earlier attempts of this job that were preempted and requeued."""
        return self.s.scalar(select(func.count()).select_from(Attempt).where(
            Attempt.job_id == self.job.id, Attempt.outcome == "preempted")) or 0

    @property
    def preempted(self) -> bool:
        return self.state == JobState.queued and self.failure == Failure.PREEMPTED

    @cached_property
    def same_hang(self) -> Optional[Attempt]:
        """An earlier attempt that hung at this attempt's step in its frame: the hang is deterministic."""
        if self.failure != Failure.HANG or self.step is None or not self.frame:
            return None
        return self.s.scalars(select(Attempt).where(
            Attempt.job_id == self.job.id, Attempt.attempt < self.job.attempt, Attempt.failure == Failure.HANG,
            Attempt.hang_step == self.step, Attempt.hang_frame == self.frame).order_by(Attempt.attempt)).first()

    @property
    def where(self) -> str:
        """Where the next attempt starts, for a requeue that spends no retry."""
        return f"resumes from checkpoint {self.job.checkpoint}" if self.job.checkpoint else "starts again from step 0"

    @property
    def memory(self) -> str:
        return f"; peak memory {self.peak_mb:,.0f} MiB" if self.peak_mb else ""

    @property
    def failed_retryable(self) -> bool:
        """A failure the policy would retry: a retryable class, or one the agent asks a retry for."""
        return (self.state == JobState.failed and self.failure not in FINAL_FAILURES
                and (self.retry or self.failure in RETRYABLE))

    @property
    def oom_of_a_training_job(self) -> bool:
        return self.failure == Failure.OOM and isinstance(self.spec, JobSpec)

    @property
    def smaller(self) -> Optional[JobSpec]:
        """A training job's spec with half the micro-batch; None at micro-batch 1."""
        return halve_micro_batch(self.spec, self.info) if isinstance(self.spec, JobSpec) else None


class Next(str, enum.Enum):
    """What the store does after an ending (server/store.py `_NEXT` carries each out)."""
    CANCEL = "cancel"  # the job ends cancelled, whatever the attempt reported
    RELAUNCH = "relaunch"  # the fix's spec swapped in, queued at once (store.settle_change)
    PAUSE = "pause"  # the job ends paused, to resume when a person asks
    REQUEUE = "requeue"  # back to the queue, no retry spent
    RETRY = "retry"  # back to the queue, a retry spent, from the newest checkpoint
    RETRY_SMALLER = "retry_smaller"  # a retry spent: half the micro-batch, twice the accumulation, step 0
    FINAL = "final"  # the job ends in the state reported (a failure not retried says why)
    FAIL = "fail"  # the job ends failed, whatever state the attempt reported (a limit says why)


@dataclass(frozen=True)
class Outcome:
    """One row: an ending and what follows it. `decision` is the attempt's `decision` column (why the
    next attempt was, or was not, made); `reason`, where given, replaces the job's reason."""
    name: str
    when: Callable[[Ending], bool]
    next: Next
    decision: Callable[[Ending], Optional[str]] = lambda e: None
    reason: Optional[Callable[[Ending], Optional[str]]] = None
    outcome: Optional[str] = None  # the attempt's outcome where it is not the job's next state


def _given_up(e: Ending) -> str:
    used, most = e.used, e.spec.max_retries
    return f"gave up after {used} retr{'y' if used == 1 else 'ies'} (max_retries={most}){e.memory}"


def _preempted_too_often(e: Ending) -> str:
    return (f"preempted {e.preemptions + 1} times, past the cap of {MAX_PREEMPTIONS} requeues "
            f"(max_preemptions; an admin raises it with TOKENPULSE_MAX_PREEMPTIONS): not requeued")


def _deterministic(e: Ending) -> str:
    assert e.same_hang is not None
    return (f"deterministic hang: attempt {e.same_hang.attempt} hung at the same step {e.step} in the same "
            f"frame {e.frame}; not retried (it would hang there again)")


def _at_micro_batch_one(e: Ending) -> str:
    return f"out of memory at micro-batch 1: nothing left to halve{e.memory}"


def _not_retried(e: Ending) -> str:
    return f"not retried: {NOT_RETRIED.get(str(e.failure), 'the agent did not ask for a retry')}"


RETRY_STATES = (JobState.failed, JobState.paused, JobState.queued)

# The table, first match wins: the order is the policy (a cancel beats a fix, a fix beats a retry; a
# deterministic hang is not retried even with budget left; the budget is checked before an OOM's halving).
OUTCOMES: tuple[Outcome, ...] = (
    Outcome("cancel asked", lambda e: e.asked == "cancel" and e.state in RETRY_STATES, Next.CANCEL,
            lambda e: "cancelled by user: no further attempt",
            reason=lambda e: f"cancelled by user ({e.reason})" if e.reason else "cancelled by user"),
    Outcome("fix's pause ended", lambda e: e.state in (JobState.paused, JobState.queued) and e.change is not None,
            Next.RELAUNCH),
    Outcome("preempted, pause asked", lambda e: e.preempted and e.asked == "pause", Next.PAUSE,
            lambda e: f"paused as asked; {e.where} on resume"),
    Outcome("preempted past the cap", lambda e: e.preempted and e.preemptions >= MAX_PREEMPTIONS, Next.FAIL,
            _preempted_too_often, reason=lambda e: f"{e.reason}; {_preempted_too_often(e)}" if e.reason
            else _preempted_too_often(e)),
    Outcome("preempted", lambda e: e.preempted, Next.REQUEUE,
            lambda e: (f"requeued: preempted (a SIGTERM not sent by its agent, or the scheduler's preemption); "
                       f"{e.where}; a preemption is not the job's fault: no retry spent"), outcome="preempted"),
    Outcome("agent stopped", lambda e: e.state == JobState.queued, Next.REQUEUE,
            lambda e: f"requeued (its agent stopped or could not run it here); {e.where}; no retry spent",
            outcome="queued"),
    Outcome("final class (spec, nan, disk_full, data)",
            lambda e: e.state == JobState.failed and e.failure in FINAL_FAILURES, Next.FINAL, _not_retried),
    Outcome("failure not retried (a command's error, an unknown class)",
            lambda e: e.state == JobState.failed and not e.failed_retryable, Next.FINAL, _not_retried),
    Outcome("deterministic hang", lambda e: e.failed_retryable and e.same_hang is not None, Next.FINAL,
            lambda e: f"not retried: {_deterministic(e)}", reason=lambda e: f"{e.reason}; {_deterministic(e)}"),
    Outcome("retry budget spent", lambda e: e.failed_retryable and e.used >= e.spec.max_retries, Next.FINAL,
            lambda e: f"not retried: {_given_up(e)}", reason=lambda e: f"{e.reason}; {_given_up(e)}"),
    Outcome("oom at micro-batch 1", lambda e: e.failed_retryable and e.oom_of_a_training_job and e.smaller is None,
            Next.FINAL, lambda e: f"not retried: {_at_micro_batch_one(e)}",
            reason=lambda e: f"{e.reason}; {_at_micro_batch_one(e)}"),
    Outcome("oom", lambda e: e.failed_retryable and e.oom_of_a_training_job, Next.RETRY_SMALLER),
    Outcome("retryable failure (crash, signal, lost, hang, collective timeout, or asked)",
            lambda e: e.failed_retryable, Next.RETRY),
    Outcome("ended (completed, paused, cancelled)", lambda e: True, Next.FINAL),
)


def choose(e: Ending) -> Outcome:
    """The first row of OUTCOMES whose ending this is (the last row matches every ending)."""
    return next(row for row in OUTCOMES if row.when(e))
