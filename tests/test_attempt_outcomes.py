"""Every row of the end-of-attempt table (server/attempt_outcomes.py OUTCOMES), driven through the real
store (store.end_attempt) on a real, migrated SQLite database: the row the ending picks, the job's
next state, and what the attempt row keeps (outcome, decision, change)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
from sqlalchemy import select

from server import store
from server.attempt_outcomes import MAX_PREEMPTIONS, OUTCOMES, Ending, choose
from server.models import Attempt, Job, JobChange
from tests.realdb import add_agent, migrated_session
from tokenpulse.protocol import CommandSpec, JobSpec, JobState


@pytest.fixture
def s(tmp_path):
    with migrated_session(tmp_path) as session:
        yield session


def running(s, spec=None) -> Job:
    job = store.create_job(s, spec or JobSpec(max_retries=2))
    agent = add_agent(s, f"agent-{job.id}")
    agent.accepts_commands = True
    assert store.claim(s, agent.id).id == job.id
    store.transition(s, job, JobState.running)
    return job


def pending_fix(s, job: Job) -> JobChange:
    """A fix waiting for the pause it asked for (as server/fixes.py keeps it)."""
    after = JobSpec.model_validate_json(job.spec).model_copy(update={"padding": "pack"})
    change = JobChange(job_id=job.id, kind="padding", state="pending",
                       changes=json.dumps({"padding": ["auto", "pack"]}),
                       fix=json.dumps({"spec_after": after.model_dump_json(), "title": "pack the rows",
                                       "changes": {"padding": ["auto", "pack"]}}),
                       resume="checkpoint", created_at=time.time())
    s.add(change)
    store.request_pause(s, job)
    s.flush()
    return change


def hung_once(s, job: Job) -> None:
    """An earlier attempt hung at step 5 in train.py:10, was retried, and the job runs again."""
    assert store.end_attempt(s, job, JobState.failed, "stalled", "hang", step=5, frame="train.py:10") == "queued"
    assert store.claim(s, add_agent(s, "again").id).id == job.id
    store.transition(s, job, JobState.running)


def preempted_to_the_cap(s, job: Job, times: Optional[int] = None) -> None:
    """The job preempted and requeued `times` times (default: the cap, MAX_PREEMPTIONS), running again."""
    for _ in range(MAX_PREEMPTIONS if times is None else times):
        assert store.end_attempt(s, job, JobState.queued, "SIGTERM", "preempted") == "queued"
        assert store.claim(s, add_agent(s, f"agent-{job.id}-{job.attempt}").id).id == job.id
        store.transition(s, job, JobState.running)


def failed_naming_the_cap(s, job, attempt):
    assert job.reason.startswith(f"why it ended; preempted {MAX_PREEMPTIONS + 1} times, past the cap"), job.reason
    assert job.failure == "preempted"


@dataclass
class Case:
    row: str  # the OUTCOMES row this ending must pick
    state: JobState  # as reported
    failure: Optional[str]
    then: JobState  # the job's state after
    outcome: str  # the attempt's outcome
    decision: Optional[str]  # a piece of the attempt's decision (None: no decision)
    spec: Optional[object] = None
    before: Callable = lambda s, job: None
    retry: bool = False
    check: Callable = lambda s, job, attempt: None
    kw: dict = field(default_factory=dict)


def checkpointed(s, job):
    job.checkpoint = "ckpt/step-7"


def relaunched_with_the_fix(s, job, attempt):
    change = s.scalar(select(JobChange).where(JobChange.job_id == job.id))
    assert change.state == "applied" and json.loads(job.spec)["padding"] == "pack"
    assert attempt.change == json.dumps({"padding": ["auto", "pack"]})


def fix_dropped(s, job, attempt):
    change = s.scalar(select(JobChange).where(JobChange.job_id == job.id))
    assert change.state == "dropped" and "ended failed before its checkpoint" in change.verdict
    assert json.loads(job.spec)["padding"] == "auto"


def halved(s, job, attempt):
    spec = json.loads(job.spec)
    assert (spec["batch_size"], spec["grad_accum"]) == (4, 4) and job.checkpoint is None
    assert json.loads(attempt.change) == {"batch_size": [8, 4], "grad_accum": [2, 4]}


CASES = [
    Case("cancel asked", JobState.failed, "crash", JobState.cancelled, "cancelled", "cancelled by user: no further",
         before=lambda s, job: store.request_cancel(s, job)),
    Case("cancel asked", JobState.paused, None, JobState.cancelled, "cancelled", "no further attempt",
         before=lambda s, job: (pending_fix(s, job), store.request_cancel(s, job))),
    Case("fix's pause ended", JobState.paused, None, JobState.queued, "changed", "fix #1 applied (pack the rows)",
         before=lambda s, job: (checkpointed(s, job), pending_fix(s, job)), check=relaunched_with_the_fix),
    Case("fix's pause ended", JobState.queued, None, JobState.queued, "changed", "relaunched from checkpoint",
         before=lambda s, job: (checkpointed(s, job), pending_fix(s, job)), check=relaunched_with_the_fix),
    Case("preempted, pause asked", JobState.queued, "preempted", JobState.paused, "paused",
         "paused as asked; resumes from checkpoint ckpt/step-7 on resume",
         before=lambda s, job: (checkpointed(s, job), store.request_pause(s, job))),
    Case("preempted past the cap", JobState.queued, "preempted", JobState.failed, "failed",
         f"preempted {MAX_PREEMPTIONS + 1} times, past the cap of {MAX_PREEMPTIONS} requeues (max_preemptions; an "
         "admin raises it with TOKENPULSE_MAX_PREEMPTIONS): not requeued",
         before=lambda s, job: preempted_to_the_cap(s, job), check=failed_naming_the_cap),
    Case("preempted", JobState.queued, "preempted", JobState.queued, "preempted", "no retry spent",
         before=lambda s, job: preempted_to_the_cap(s, job, MAX_PREEMPTIONS - 1)),
    Case("agent stopped", JobState.queued, None, JobState.queued, "queued",
         "requeued (its agent stopped or could not run it here); starts again from step 0; no retry spent"),
    *[Case("final class (spec, nan, disk_full, data)", JobState.failed, f, JobState.failed, "failed", why, retry=True)
      for f, why in [("spec", "fix the named field"), ("nan", "non-finite loss"),
                     ("disk_full", "the same disk would fill again"), ("data", "fails on the same row again")]],
    Case("failure not retried (a command's error, an unknown class)", JobState.failed, "error", JobState.failed,
         "failed", "the command's own failure", spec=CommandSpec(command=["false"], max_retries=3)),
    Case("failure not retried (a command's error, an unknown class)", JobState.failed, "other", JobState.failed,
         "failed", "the agent did not ask for a retry"),
    Case("deterministic hang", JobState.failed, "hang", JobState.failed, "failed",
         "deterministic hang: attempt 1 hung at the same step 5 in the same frame train.py:10", before=hung_once,
         kw={"step": 5, "frame": "train.py:10"}),
    Case("retry budget spent", JobState.failed, "crash", JobState.failed, "failed",
         "not retried: gave up after 0 retries (max_retries=0)", spec=JobSpec(max_retries=0)),
    Case("retry budget spent", JobState.failed, "oom", JobState.failed, "failed",
         "gave up after 0 retries (max_retries=0); peak memory 1,234 MiB",
         spec=JobSpec(max_retries=0, batch_size=1), kw={"peak_mb": 1234.0}),
    Case("oom at micro-batch 1", JobState.failed, "oom", JobState.failed, "failed",
         "out of memory at micro-batch 1: nothing left to halve; peak memory 900 MiB",
         spec=JobSpec(batch_size=1, grad_accum=1), kw={"peak_mb": 900.0}),
    Case("oom", JobState.failed, "oom", JobState.queued, "retried", "retry 1 of 3: out of memory, half the micro-batch",
         spec=JobSpec(batch_size=8, grad_accum=2, max_retries=3), before=checkpointed, check=halved),
    *[Case("retryable failure (crash, signal, lost, hang, collective timeout, or asked)", JobState.failed, f,
           JobState.queued, "retried", "retry 1 of 2", before=checkpointed) for f in
      ("crash", "signal", "lost", "hang", "collective_timeout")],
    Case("retryable failure (crash, signal, lost, hang, collective timeout, or asked)", JobState.failed, "node_fail",
         JobState.queued, "retried", "retry 1 of 2: retried; running the command again", retry=True,
         spec=CommandSpec(command=["true"], max_retries=2)),
    Case("retryable failure (crash, signal, lost, hang, collective timeout, or asked)", JobState.failed, "crash",
         JobState.queued, "retried", "a crash, again from the newest checkpoint; retrying from step 0",
         before=lambda s, job: pending_fix(s, job), check=fix_dropped),
    Case("ended (completed, paused, cancelled)", JobState.completed, None, JobState.completed, "completed", None),
    Case("ended (completed, paused, cancelled)", JobState.paused, None, JobState.paused, "paused", None),
]


def test_every_row_has_a_case():
    assert [r.name for r in OUTCOMES] == list(dict.fromkeys(c.row for c in CASES))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.row}-{c.state.value}-{c.failure}")
def test_each_ending_takes_its_row(s, case):
    job = running(s, case.spec)
    case.before(s, job)
    attempt = s.get(Attempt, (job.id, job.attempt))
    ending = Ending(s, job, case.state, "why it ended", case.failure, case.retry, attempt, 0.0, **case.kw)
    assert choose(ending).name == case.row
    assert store.end_attempt(s, job, case.state, "why it ended", case.failure, retry=case.retry,
                             **case.kw) == case.then
    assert job.state == case.then.value
    assert attempt.outcome == case.outcome and attempt.ended_at is not None
    if case.decision is None:
        assert attempt.decision is None
    else:
        assert case.decision in attempt.decision
    assert attempt.failure_class == case.failure
    case.check(s, job, attempt)
