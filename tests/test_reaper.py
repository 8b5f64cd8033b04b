"""The reaper (server/reaper.py) on a real, migrated SQLite database: a silent agent is lost, its
jobs go to the retry policy with a critical alert, and nothing else is touched."""
from __future__ import annotations

import pytest
from sqlalchemy import select

from server import store
from server.models import Alert, Attempt, Job
from server.reaper import reap
from tests.realdb import add_agent, migrated_session
from tokenpulse.protocol import JobSpec, JobState

NOW = 100_000.0
LEASE = 30.0


@pytest.fixture
def s(tmp_path):
    with migrated_session(tmp_path) as session:
        yield session


def claimed(s, agent, **spec) -> Job:
    job = store.create_job(s, JobSpec(**spec))
    assert store.claim(s, agent.id).id == job.id
    store.transition(s, job, JobState.running)
    return job


def test_a_silent_agent_is_lost_and_its_job_requeued_with_a_critical_alert(s):
    silent = add_agent(s, "silent", seen_at=NOW - LEASE - 1)
    job = claimed(s, silent, max_retries=1)
    job.checkpoint = "ckpt/step-3"
    frames = reap(s, LEASE, started_at=0.0, now=NOW)
    assert silent.state == "lost"
    assert job.state == "queued" and job.agent_id is None and job.failure == "lost"
    assert "no heartbeat for 31 s" in job.reason and "retrying from checkpoint ckpt/step-3" in job.reason
    attempt = s.scalars(select(Attempt).where(Attempt.job_id == job.id)).one()
    assert (attempt.outcome, attempt.failure) == ("retried", "lost")
    alert = s.scalars(select(Alert).where(Alert.job_id == job.id)).one()
    assert (alert.kind, alert.severity, alert.state) == ("worker_lost", "critical", "open")
    assert "requeued after attempt 1" in alert.message
    topics = [(topic, payload["type"]) for topic, payload, _ in frames]
    assert topics == [("agents", "agent"), ("alerts", "alert"), ("jobs", "job"), (f"job:{job.id}", "job")]
    assert frames[2][1]["job"]["state"] == "queued"
    assert reap(s, LEASE, started_at=0.0, now=NOW + 60) == []  # lost once, not again


def test_a_lost_job_without_retries_left_fails(s):
    silent = add_agent(s, "silent", seen_at=NOW - 100)
    job = claimed(s, silent, max_retries=0)
    reap(s, LEASE, started_at=0.0, now=NOW)
    assert job.state == "failed" and "gave up after 0 retries" in job.reason
    alert = s.scalars(select(Alert).where(Alert.job_id == job.id)).one()
    assert alert.state == "open" and "job failed" in alert.message  # a failure keeps its critical alert


def test_a_lost_job_with_a_cancel_requested_ends_cancelled(s):
    silent = add_agent(s, "silent", seen_at=NOW - 100)
    job = claimed(s, silent)
    store.request_cancel(s, job)
    reap(s, LEASE, started_at=0.0, now=NOW)
    assert job.state == "cancelled"


def test_agents_within_their_lease_and_other_agents_jobs_are_untouched(s):
    alive = add_agent(s, "alive", seen_at=NOW - LEASE + 1)
    silent = add_agent(s, "silent", seen_at=NOW - LEASE - 1)
    mine = claimed(s, alive)
    theirs = claimed(s, silent)
    queued = store.create_job(s, JobSpec())
    frames = reap(s, LEASE, started_at=0.0, now=NOW)
    assert (alive.state, silent.state) == ("online", "lost")
    assert mine.state == "running" and mine.agent_id == alive.id
    assert theirs.state == "queued" and queued.state == "queued"
    assert {p["job"]["id"] for t, p, _ in frames if p["type"] == "job"} == {theirs.id}


def test_an_agent_lost_with_no_jobs_just_goes_lost(s):
    silent = add_agent(s, "idle", seen_at=NOW - 100)
    frames = reap(s, LEASE, started_at=0.0, now=NOW)
    assert silent.state == "lost" and [p["type"] for _, p, _ in frames] == ["agent"]


def test_no_agent_is_lost_within_a_lease_of_the_server_start(s):
    silent = add_agent(s, "silent", seen_at=NOW - 1000)
    job = claimed(s, silent)
    assert reap(s, LEASE, started_at=NOW - LEASE + 1, now=NOW) == []
    assert silent.state == "online" and job.state == "running"


def test_a_state_rule_fires_for_a_job_the_reaper_fails(s):
    """'Tell me when any job named sft-* fails': a lost worker's job fails without an agent's report,
    and the rule still fires (issue 22: state rules missed the reaper's failures)."""
    from server.models import AlertRule
    from server.rules import RULES
    rule = AlertRule(name="sft fails", scope="name", pattern="sft-*", condition="state", state="failed",
                     severity="critical", channels="[]", created_at=NOW)
    s.add(rule)
    s.flush()
    RULES.changed()  # the rule set is cached per process: read this database's
    silent = add_agent(s, "silent", seen_at=NOW - 100)
    job = claimed(s, silent, max_retries=0, name="sft-small")
    other = claimed(s, add_agent(s, "silent too", seen_at=NOW - 100), max_retries=0, name="pretrain")
    frames = reap(s, LEASE, started_at=0.0, now=NOW)
    assert job.state == other.state == "failed"
    fired = s.scalars(select(Alert).where(Alert.kind == f"rule:{rule.id}")).all()
    assert [(a.job_id, a.state, a.severity) for a in fired] == [(job.id, "open", "critical")]
    assert "sft fails: job" in fired[0].message and "is failed" in fired[0].message
    assert any(p["type"] == "alert" and p["alert"]["kind"] == f"rule:{rule.id}" for _, p, _ in frames)
    RULES.changed()


def test_an_agent_whose_message_waits_on_this_servers_writer_is_not_lost(s):
    """Its heartbeat arrived but waits behind other writes on a busy server (heartbeats.Arriving): the
    delay is the server's. Spared while its message is held; lost once nothing of it is."""
    from server.ingest.heartbeats import Arriving
    quiet = add_agent(s, "quiet", seen_at=NOW - LEASE - 5)
    job = claimed(s, quiet, max_retries=1)
    arriving = Arriving()
    arriving.add(quiet.id)
    arriving.add(quiet.id)  # a heartbeat and an event batch
    assert reap(s, LEASE, started_at=0.0, now=NOW, arriving=frozenset(arriving.agents())) == []
    arriving.done(quiet.id)
    assert reap(s, LEASE, started_at=0.0, now=NOW, arriving=frozenset(arriving.agents())) == []
    assert quiet.state == "online" and job.state == "running"
    arriving.done(quiet.id)
    assert arriving.agents() == set()
    reap(s, LEASE, started_at=0.0, now=NOW, arriving=frozenset(arriving.agents()))
    assert quiet.state == "lost" and job.state == "queued"


def test_the_time_this_servers_loop_stood_still_is_not_counted_against_a_lease(s):
    """An agent's heartbeats wait unread in its socket while the server's event loop cannot run (the
    reaper's sleep woke late; heartbeats.LoopPauses): that silence is the server's. Counted out of
    the lease; the agent is lost once its own silence fills a lease."""
    from server.ingest.heartbeats import LoopPauses
    quiet = add_agent(s, "quiet", seen_at=NOW - LEASE - 3)
    job = claimed(s, quiet, max_retries=1)
    pauses = LoopPauses()
    pauses.note(0.1, now=NOW - LEASE - 10)  # jitter: not counted (and before its last heartbeat anyway)
    pauses.note(4.0, now=NOW - 1)  # the loop stood still 4 s after the agent's last heartbeat
    assert pauses.since(NOW - LEASE - 3) == 4.0
    assert reap(s, LEASE, started_at=0.0, now=NOW, paused=pauses.since) == []
    assert quiet.state == "online" and job.state == "running"
    reap(s, LEASE, started_at=0.0, now=NOW + 1.5, paused=pauses.since)  # 1.5 s more of its own: a lease
    assert quiet.state == "lost" and job.state == "queued"
    # a pause that began before its last heartbeat counts only from then on
    assert pauses.since(NOW - 2) == 1.0
