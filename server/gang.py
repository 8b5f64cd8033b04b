"""Gang claims: a job with nnodes = K runs on K agents at once, each starting torchrun with its node
rank and the rendezvous endpoint of node rank 0's agent.

All or nothing: an agent that claims while a multi-node job is queued joins its forming gang (a
gang_members row for the next attempt) and is told to wait (202); when the K-th agent joins, the job
starts (`starting`, one attempts row, jobs.agent_id = node rank 0's agent, which reports the job's
events) and every member's next claim gets its share. A gang that does not fill within
gang_timeout_s is dissolved: no agent sits on a partial gang. A full gang takes no further agent.
Runs on the writer thread, inside the claim's transaction.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from server.models import NEW_ATTEMPT_STEP, Agent, Attempt, GangMember, Job, Token
from tokenpulse.protocol import ACTIVE_STATES, TRAIN, JobState


@dataclass
class Share:
    job: Job
    node_rank: int
    endpoint: Optional[str]


@dataclass
class Waiting:
    job_id: int
    members: int
    nnodes: int


def members(s: Session, job: Job) -> list[int]:
    """Agents holding a share of the job's current attempt."""
    return list(s.scalars(select(GangMember.agent_id).where(GangMember.job_id == job.id,
                                                            GangMember.attempt == job.attempt)))


def _forming(s: Session, job: Job) -> list[GangMember]:
    return list(s.scalars(select(GangMember).where(GangMember.job_id == job.id, GangMember.attempt == job.attempt + 1)
                          .order_by(GangMember.node_rank)))


def claim(s: Session, agent: Agent, endpoint: Optional[str], timeout_s: float, trusted: bool = False):
    """Share (start your part now), Waiting (your gang is gathering: ask again), or None (no gang
    job for you: claim as usual). Only a trusted agent (its token has the `gang` right, given by an
    admin) joins a gang: node rank 0 can run code in the ranks that connect to it, so who may be
    any rank of a gang is the control."""
    now = time.time()
    # 1. a share of a gang that started: handed out once to each member
    mine = s.execute(select(GangMember, Job).join(Job, Job.id == GangMember.job_id).where(
        GangMember.agent_id == agent.id, GangMember.attempt == Job.attempt, GangMember.handed_at.is_(None),
        Job.state.in_([x.value for x in ACTIVE_STATES]))).first()
    if mine is not None:
        m, job = mine
        m.handed_at = now
        return Share(job, m.node_rank, _endpoint(s, job.id, job.attempt))
    # 2. a gang this agent is gathering with
    mine = s.execute(select(GangMember, Job).join(Job, Job.id == GangMember.job_id).where(
        GangMember.agent_id == agent.id, GangMember.attempt == Job.attempt + 1,
        Job.state == JobState.queued.value)).first()
    if mine is not None:
        return _settle(s, mine[1], agent, now, timeout_s)
    # 3. join the best queued multi-node job that still has room
    if not trusted:
        return None
    for job in s.scalars(select(Job).where(Job.state == JobState.queued.value, Job.nnodes > 1, Job.kind == TRAIN)
                         .order_by(Job.priority.desc(), Job.id)):
        gathered = _forming(s, job)
        if len(gathered) >= job.nnodes:
            continue  # full: the gang is starting, a third agent takes no half of it
        s.add(GangMember(job_id=job.id, attempt=job.attempt + 1, node_rank=len(gathered), agent_id=agent.id,
                         endpoint=endpoint if not gathered else None, joined_at=now))
        s.flush()
        return _settle(s, job, agent, now, timeout_s)
    return None


def trusted_shortage(s: Session, nnodes: int) -> Optional[str]:
    """At submit: why a multi-node job would wait, when fewer agents trusted for gangs are online."""
    online = s.scalar(select(func.count()).select_from(Agent).join(Token, Token.id == Agent.token_id).where(
        Agent.state == "online", Token.revoked_at.is_(None), Token.scopes.contains("gang"))) or 0
    if online >= nnodes:
        return None
    return (f"waiting for {nnodes} agents trusted for multi-node jobs ({online} online): only agents whose token "
            "an admin created with --gang join a gang")


def _settle(s: Session, job: Job, agent: Agent, now: float, timeout_s: float):
    gathered = _forming(s, job)
    if len(gathered) >= job.nnodes:
        lead = gathered[0]
        s.execute(update(Job).where(Job.id == job.id).values(  # the new attempt's own metrics, phases, step
            state=JobState.starting.value, agent_id=lead.agent_id, attempt=Job.attempt + 1, alive_at=now, reason=None,
            last=None, phase=None, step=NEW_ATTEMPT_STEP))
        s.refresh(job)
        s.add(Attempt(job_id=job.id, attempt=job.attempt, agent_id=lead.agent_id, started_at=now,
                      resumed_from=job.checkpoint))
        me = next(m for m in gathered if m.agent_id == agent.id)
        me.handed_at = now
        return Share(job, me.node_rank, lead.endpoint)
    if now - min(m.joined_at for m in gathered) > timeout_s:
        # all or nothing: a gang that did not gather in time lets its agents go
        s.execute(delete(GangMember).where(GangMember.job_id == job.id, GangMember.attempt == job.attempt + 1))
        job.reason = (f"a gang of {job.nnodes} agents did not gather within {timeout_s:.0f} s "
                      f"({len(gathered)} joined); waiting for agents")
        return None
    return Waiting(job.id, len(gathered), job.nnodes)


def _endpoint(s: Session, job_id: int, attempt: int) -> Optional[str]:
    return s.scalar(select(GangMember.endpoint).where(GangMember.job_id == job_id, GangMember.attempt == attempt,
                                                      GangMember.node_rank == 0))


def lost_gangs(s: Session, agent_id: int) -> list[Job]:
    """Active multi-node jobs in which this (lost) agent holds a share other than node rank 0's:
    the whole gang fails with it."""
    return list(s.scalars(select(Job).join(GangMember, GangMember.job_id == Job.id).where(
        GangMember.agent_id == agent_id, GangMember.attempt == Job.attempt, Job.agent_id != agent_id,
        Job.state.in_([x.value for x in ACTIVE_STATES]))))


def stale_shares(s: Session, agent_id: int, job_ids: list[int]) -> list[int]:
    """Of the multi-node shares an agent still runs (the jobs whose ranks it reports without holding
    them), those whose attempt is over: the gang failed without it (node rank 0's agent lost, the
    job requeued or ended). Its ranks must stop, or they hold the agent and wait on peers forever."""
    stale = []
    for jid in job_ids:
        job = s.get(Job, jid)
        if job is None or JobState(job.state) not in ACTIVE_STATES or agent_id not in members(s, job):
            stale.append(jid)
    return stale


def request_stacks(s: Session, job: Job) -> int:
    """Node rank 0's agent asks the other members for their ranks' stacks (a stall, or a person's
    stack request): their next heartbeat reply says `stack`. The stacks of an earlier ask are
    dropped, so what is read back is of now. Returns how many members were asked."""
    from server.models import JobRank
    now = time.time()
    asked = s.execute(update(GangMember).where(GangMember.job_id == job.id, GangMember.attempt == job.attempt,
                                               GangMember.node_rank > 0).values(stack_requested_at=now)).rowcount
    s.execute(update(JobRank).where(JobRank.job_id == job.id).values(stack=None))
    return asked


def stack_requests(s: Session, agent_id: int, job_ids: list[int]) -> list[int]:
    """Of the shares an agent runs, those whose stacks node rank 0's agent asked for; handed out once."""
    if not job_ids:
        return []
    rows = list(s.scalars(select(GangMember).join(Job, Job.id == GangMember.job_id).where(
        GangMember.agent_id == agent_id, GangMember.job_id.in_(job_ids), GangMember.attempt == Job.attempt,
        GangMember.stack_requested_at.is_not(None))))
    for m in rows:
        m.stack_requested_at = None
    return [m.job_id for m in rows]
