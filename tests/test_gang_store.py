"""Server side of a gang's end, on a real database through the migrations (SQLite, or PostgreSQL
with TOKENPULSE_TEST_DB=postgresql): the rank table's exit column, a member's share made stale by
its lead's loss, and the stacks another node sends for a multi-node stall."""
from __future__ import annotations

import pytest

from server import gang, ranks, store
from server.reaper import reap
from tests.realdb import add_agent, migrated_session
from tokenpulse.protocol import JobSpec, JobState, RankReport


@pytest.fixture
def s(tmp_path):
    with migrated_session(tmp_path) as session:
        yield session


def started_gang(s):
    lead, member = add_agent(s, "lead", seen_at=1000.0), add_agent(s, "member", seen_at=1000.0)
    job = store.create_job(s, JobSpec(nnodes=2, max_retries=1))
    assert isinstance(gang.claim(s, lead, "127.0.0.1:1", 60, trusted=True), gang.Waiting)
    share = gang.claim(s, member, None, 60, trusted=True)
    assert isinstance(share, gang.Share) and share.node_rank == 1
    ranks.store(s, lead.id, {job.id: [RankReport(rank=0, host="h", pid=10, step=3)]})
    ranks.store(s, member.id, {job.id: [RankReport(rank=1, host="h", pid=11, step=3, stack="Thread 11 ...")]})
    return job, lead, member


def exits(s, job) -> dict:
    return {r["rank"]: r["exit"] for r in ranks.table(s, job.id)}


def test_a_lost_lead_fails_the_gang_its_ranks_say_so_and_the_member_share_is_stale(s):
    job, lead, member = started_gang(s)
    assert gang.stale_shares(s, member.id, [job.id]) == []  # its share is current
    assert [x["rank"] for x in ranks.stacks(s, job.id)] == [1]
    lead.seen_at = 0.0  # silent
    reap(s, lost_after_s=10, now=1005.0)
    s.refresh(job)
    assert job.state == JobState.queued.value  # retried as a whole
    assert exits(s, job) == {0: "lost with its agent", 1: "stopped by gang"}
    assert gang.stale_shares(s, member.id, [job.id]) == [job.id]  # the heartbeat reply cancels it
    assert ranks.stacks(s, job.id) == []  # given with the attempt


def test_the_agents_exits_win_and_the_ranks_it_could_not_see_are_filled(s):
    job, lead, member = started_gang(s)
    store.end_attempt(s, job, JobState.failed, "rank 0 crashed", "crash", 1, None, True,
                      rank_exits={0: "exited with code 1"})
    assert exits(s, job) == {0: "exited with code 1", 1: "stopped by gang"}
    late = RankReport(rank=1, host="h", pid=11, step=4)  # a heartbeat after the end changes nothing
    ranks.store(s, member.id, {job.id: [late]})
    assert exits(s, job)[1] == "stopped by gang"


def test_a_completed_gang_says_completed_for_every_rank(s):
    job, lead, member = started_gang(s)
    store.end_attempt(s, job, JobState.completed, None, None, rank_exits={0: "completed"})
    assert exits(s, job) == {0: "completed", 1: "completed"}


def test_node_rank_0_asks_the_members_for_stacks_once_and_reads_fresh_ones(s):
    job, lead, member = started_gang(s)
    assert gang.stack_requests(s, member.id, [job.id]) == []  # nobody asked
    assert gang.request_stacks(s, job) == 1  # one other node
    assert ranks.stacks(s, job.id) == []  # an earlier ask's stacks are not of now
    assert gang.stack_requests(s, lead.id, [job.id]) == []  # node rank 0 is not asked
    assert gang.stack_requests(s, member.id, [job.id]) == [job.id]
    assert gang.stack_requests(s, member.id, [job.id]) == []  # handed out once
    ranks.store(s, member.id, {job.id: [RankReport(rank=1, stack="Thread 11 (idle): \"MainThread\"")]})
    assert [(x["rank"], x["host"], x["pid"]) for x in ranks.stacks(s, job.id)] == [(1, "h", 11)]
