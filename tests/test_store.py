"""The job state machine (server/store.py) on a real, migrated SQLite database: every transition
allowed or refused, what a person may ask of each state, claims by priority, the retry policy."""
from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from server import attempt_outcomes, store
from server.models import Alert, Attempt, Job
from tests.realdb import add_agent, migrated_session
from tokenpulse.protocol import ACTIVE_STATES, FINAL_STATES, JobSpec, JobState


@pytest.fixture
def s(tmp_path):
    with migrated_session(tmp_path) as session:
        yield session


def new_job(s, **spec) -> Job:
    return store.create_job(s, JobSpec(**spec))


def running_job(s, agent=None, **spec) -> Job:
    """A job claimed by an agent and running, as after claim + first event."""
    agent = agent or add_agent(s, f"agent-{len(s.scalars(select(Job)).all())}")
    job = new_job(s, **spec)
    assert store.claim(s, agent.id).id == job.id
    store.transition(s, job, JobState.running)
    return job


def attempts(s, job) -> list[Attempt]:
    return list(s.scalars(select(Attempt).where(Attempt.job_id == job.id).order_by(Attempt.attempt)))


ALLOWED = {
    JobState.queued: {JobState.starting, JobState.cancelled},
    JobState.starting: {JobState.running, JobState.queued, JobState.completed, JobState.failed,
                        JobState.cancelled, JobState.paused},
    JobState.running: {JobState.queued, JobState.completed, JobState.failed, JobState.cancelled, JobState.paused},
    JobState.paused: {JobState.queued, JobState.cancelled},
}


@pytest.mark.parametrize("old", list(JobState))
@pytest.mark.parametrize("new", list(JobState))
def test_every_transition_allowed_or_refused(s, old, new):
    job = new_job(s)
    job.state = old.value
    allowed = new == old or new in ALLOWED.get(old, set())
    if not allowed:
        with pytest.raises(store.TransitionError, match=f"is {old.value}; it cannot become {new.value}"):
            store.transition(s, job, new)
        assert job.state == old.value
        return
    job.requested_action, job.agent_id = "pause", None
    store.transition(s, job, new, reason="why")
    assert job.state == new.value
    if new != old and (new in FINAL_STATES or new in (JobState.queued, JobState.paused)):
        assert job.requested_action is None  # a request does not outlive the attempt it was for
    if new != old and new in FINAL_STATES:
        assert job.finished_at is not None and job.reason == "why"


def test_final_states_refuse_everything_but_themselves():
    for final in FINAL_STATES:
        assert store.TRANSITIONS[final] == set()


def test_final_state_clears_open_alerts_but_a_failure_keeps_its_critical_ones(s):
    for end in (JobState.completed, JobState.failed):
        job = running_job(s)
        for sev in ("warning", "critical"):
            s.add(Alert(job_id=job.id, kind=f"k-{sev}", severity=sev, state="open", message="m",
                        created_at=0.0, updated_at=0.0))
        s.flush()
        store.transition(s, job, end)
        states = dict(s.execute(select(Alert.severity, Alert.state).where(Alert.job_id == job.id)).all())
        assert states == {"warning": "cleared", "critical": "open" if end == JobState.failed else "cleared"}


# ---- what a person asks for ------------------------------------------------------------------

REQUEST_RULES = {
    # action: state -> (new state, requested_action) or the refusal's words
    "cancel": {JobState.queued: (JobState.cancelled, None), JobState.paused: (JobState.cancelled, None),
               JobState.starting: (JobState.starting, "cancel"), JobState.running: (JobState.running, "cancel"),
               JobState.completed: "only queued, paused or running jobs can be cancelled",
               JobState.failed: "only queued, paused or running jobs can be cancelled",
               JobState.cancelled: "only queued, paused or running jobs can be cancelled"},
    "pause": {JobState.starting: (JobState.starting, "pause"), JobState.running: (JobState.running, "pause")},
    "resume": {JobState.paused: (JobState.queued, None)},
    "stack": {JobState.starting: (JobState.starting, None), JobState.running: (JobState.running, None)},
}
REFUSALS = {"pause": "only a running job can be paused", "resume": "only a paused job can be resumed",
            "stack": "it has no process to inspect"}


@pytest.mark.parametrize("action", list(REQUEST_RULES))
@pytest.mark.parametrize("state", list(JobState))
def test_requests_follow_the_rules_of_each_state(s, action, state):
    job = new_job(s)
    job.state = state.value
    if state in ACTIVE_STATES:
        job.agent_id = add_agent(s).id
    rule = REQUEST_RULES[action].get(state, REFUSALS.get(action))
    if isinstance(rule, str):
        with pytest.raises(store.TransitionError, match=f"job {job.id} is {state.value}; {rule}"):
            store.REQUESTS[action](s, job)
        assert job.state == state.value and job.requested_action is None
        return
    store.REQUESTS[action](s, job)
    assert (JobState(job.state), job.requested_action) == rule
    if rule[0] == JobState.cancelled:
        assert job.reason == "cancelled by user"
    if action == "resume":
        assert job.reason == "resumed by user"


# ---- claims ---------------------------------------------------------------------------------

def test_claim_takes_highest_priority_then_oldest_and_respects_capacity(s):
    low, high1, mid, high2 = (new_job(s, priority=p) for p in (-1, 5, 0, 5))
    agent = add_agent(s, capacity=2)
    got = [store.claim(s, agent.id).id for _ in range(2)]
    assert got == [high1.id, high2.id]
    assert store.claim(s, agent.id) is None  # full: capacity 2
    other = add_agent(s, "b", capacity=5)
    assert [store.claim(s, other.id).id for _ in range(2)] == [mid.id, low.id]
    assert store.claim(s, other.id) is None  # nothing queued
    assert store.claim(s, 10_000) is None  # not an agent
    for job in (high1, high2):
        assert (job.state, job.agent_id, job.attempt) == ("starting", agent.id, 1)
        assert [(a.attempt, a.agent_id, a.ended_at) for a in attempts(s, job)] == [(1, agent.id, None)]


def test_claim_records_the_checkpoint_it_resumes_from(s):
    job = running_job(s)
    job.checkpoint = "ckpt/step-10"
    store.end_attempt(s, job, JobState.failed, "boom", "crash")
    agent = add_agent(s, "next")
    assert store.claim(s, agent.id).id == job.id
    assert [a.resumed_from for a in attempts(s, job)] == [None, "ckpt/step-10"]
    assert job.attempt == 2


def test_a_job_missing_from_heartbeats_for_a_lease_is_lost(s):
    agent = add_agent(s)
    job = running_job(s, agent)
    job.alive_at = 0.0
    assert store.reconcile(s, agent.id, set(), lease_s=30, since=0.0) == [job]
    assert job.state == "queued" and job.failure == "lost"
    fresh = running_job(s, agent, priority=9)  # alive just now (claim): within its lease
    assert store.reconcile(s, agent.id, set(), lease_s=30, since=0.0) == []
    fresh.alive_at = 0.0
    assert store.reconcile(s, agent.id, {fresh.id}, lease_s=30, since=0.0) == []  # reported: fine
    import time
    assert store.reconcile(s, agent.id, set(), lease_s=30, since=time.time()) == []  # server just started


# ---- end_attempt: the retry policy ---------------------------------------------------------------

@pytest.mark.parametrize("failure", sorted(attempt_outcomes.RETRYABLE - {"oom"}))
def test_retryable_failures_requeue_until_max_retries(s, failure):
    job = running_job(s, max_retries=2)
    job.checkpoint = "ckpt/step-5"
    for n in (1, 2):
        assert store.end_attempt(s, job, JobState.failed, "it broke", failure, exit_code=1) == JobState.queued
        assert job.state == "queued" and job.agent_id is None
        assert f"retrying from checkpoint ckpt/step-5 (retry {n} of 2)" in job.reason
        assert store.claim(s, add_agent(s, f"r{n}").id).id == job.id
        store.transition(s, job, JobState.running)
    assert store.end_attempt(s, job, JobState.failed, "it broke", failure) == JobState.failed
    assert "gave up after 2 retries (max_retries=2)" in job.reason
    rows = attempts(s, job)
    assert [a.outcome for a in rows] == ["retried", "retried", "failed"]
    assert rows[0].failure == failure and rows[0].exit_code == 1 and rows[0].ended_at is not None
    assert attempt_outcomes.retries_used(s, job) == 2


def test_retry_without_a_checkpoint_starts_from_step_zero(s):
    job = running_job(s)
    store.end_attempt(s, job, JobState.failed, "killed", "signal", signal="SIGKILL")
    assert "retrying from step 0 (no checkpoint yet)" in job.reason and job.signal == "SIGKILL"


def test_unknown_failure_is_retried_only_when_the_agent_asks(s):
    job = running_job(s)
    assert store.end_attempt(s, job, JobState.failed, "odd", "other") == JobState.failed
    job = running_job(s)
    assert store.end_attempt(s, job, JobState.failed, "odd", "other", retry=True) == JobState.queued


@pytest.mark.parametrize("failure", sorted(attempt_outcomes.FINAL_FAILURES))
def test_spec_and_nan_fail_at_once_even_when_retry_is_asked(s, failure):
    job = running_job(s, max_retries=5)
    assert store.end_attempt(s, job, JobState.failed, "bad", failure, retry=True) == JobState.failed
    assert job.reason == "bad" and [a.outcome for a in attempts(s, job)] == ["failed"]


def test_oom_halves_the_micro_batch_doubles_accumulation_and_restarts_from_zero(s):
    job = running_job(s, batch_size=8, grad_accum=2, max_retries=3)
    job.checkpoint = "ckpt/step-7"
    assert store.end_attempt(s, job, JobState.failed, "CUDA OOM", "oom") == JobState.queued
    spec = json.loads(job.spec)
    assert (spec["batch_size"], spec["grad_accum"]) == (4, 4) and job.checkpoint is None
    assert "retrying with batch_size=4, grad_accum=4 from step 0" in job.reason


def test_oom_with_auto_batch_reads_the_chosen_size_from_info(s):
    job = running_job(s, batch_size="auto", grad_accum="auto")
    job.info = json.dumps({"batch_size": 6, "grad_accum": 3})
    store.end_attempt(s, job, JobState.failed, "OOM", "oom")
    spec = json.loads(job.spec)
    assert (spec["batch_size"], spec["grad_accum"]) == (3, 6)


def test_oom_at_micro_batch_one_is_final(s):
    job = running_job(s, batch_size=1, grad_accum=1)
    assert store.end_attempt(s, job, JobState.failed, "OOM", "oom") == JobState.failed
    assert "nothing left to halve" in job.reason


@pytest.mark.parametrize("ended", [JobState.failed, JobState.paused])
def test_a_requested_cancel_wins_over_retry_and_pause(s, ended):
    job = running_job(s, max_retries=5)
    store.request_cancel(s, job)
    assert job.requested_action == "cancel"
    assert store.end_attempt(s, job, ended, "stopped", "crash") == JobState.cancelled
    assert job.reason == "cancelled by user (stopped)" and job.requested_action is None
    assert [a.outcome for a in attempts(s, job)] == ["cancelled"]


def test_pause_and_completion_are_recorded_on_the_attempt(s):
    job = running_job(s)
    assert store.end_attempt(s, job, JobState.paused, "paused by user", None) == JobState.paused
    assert [a.outcome for a in attempts(s, job)] == ["paused"]
    assert attempt_outcomes.retries_used(s, job) == 0  # a pause is not a retry
    store.request_resume(s, job)
    store.claim(s, add_agent(s, "again").id)
    assert store.end_attempt(s, job, JobState.completed, "done", None, exit_code=0) == JobState.completed
    assert [a.outcome for a in attempts(s, job)] == ["paused", "completed"]


def test_a_late_report_for_a_settled_job_changes_nothing(s):
    job = running_job(s)
    store.end_attempt(s, job, JobState.completed, "done", None)
    assert store.end_attempt(s, job, JobState.failed, "late", "crash") == JobState.completed
    assert job.reason == "done" and job.failure is None


def test_a_cancel_wins_over_later_requests_and_a_stack_request_overwrites_nothing(s):
    job = running_job(s)
    store.request_cancel(s, job)
    store.request_stack(s, job)  # a look at a job being cancelled is fine...
    assert job.requested_action == "cancel" and job.stack_requested_at is not None  # ...and changes nothing
    with pytest.raises(store.TransitionError, match="a cancel wins"):
        store.request_pause(s, job)
    assert job.requested_action == "cancel"
    other = running_job(s)
    store.request_pause(s, other)
    store.request_cancel(s, other)  # a pause asked first is overridden by a cancel
    assert other.requested_action == "cancel"
    store.request_stack(s, other)
    assert other.requested_action == "cancel"


def test_a_stack_request_is_handed_out_once_beside_the_cancel(s):
    from server.ingest.heartbeats import pending_commands
    job = running_job(s)
    store.request_cancel(s, job)
    store.request_stack(s, job)
    s.flush()
    first = {(c.job_id, c.action) for c in pending_commands(s, job.agent_id, [job.id])}
    assert first == {(job.id, "cancel"), (job.id, "stack")}
    again = {(c.job_id, c.action) for c in pending_commands(s, job.agent_id, [job.id])}
    assert again == {(job.id, "cancel")}  # the cancel stays until the job ends; the stack was one-shot

