"""Per-rank telemetry of distributed jobs: what heartbeats report about each rank, stored one row
per (job, rank) and read back as the job's rank table. Runs on the writer thread (heartbeats)."""
from __future__ import annotations

import time
from typing import Optional

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from server.models import Job, JobRank
from tokenpulse.protocol import ACTIVE_STATES, JobState, RankReport

COLUMNS = ("host", "pid", "device", "step", "step_time_s", "busy_s", "rss_mb", "alive_at", "progress_at", "exit")


def store(s: Session, agent_id: int, reports: dict[int, list[RankReport]]) -> None:
    """Upsert the reported ranks of jobs this agent runs now; a new attempt starts a fresh table."""
    now = time.time()
    for job_id, rows in reports.items():
        job = s.get(Job, job_id)
        if job is None or JobState(job.state) not in ACTIVE_STATES:
            continue
        mine = job.agent_id == agent_id or agent_id in gang_agents(s, job)
        if not mine:
            continue
        s.execute(delete(JobRank).where(JobRank.job_id == job_id, JobRank.attempt != job.attempt))
        for r in rows:
            row = s.get(JobRank, (job_id, r.rank))
            if row is None:
                row = JobRank(job_id=job_id, rank=r.rank, attempt=job.attempt, updated_at=now)
                s.add(row)
            row.agent_id, row.updated_at = agent_id, now
            for k in COLUMNS:
                v = getattr(r, k)
                if v is not None:
                    setattr(row, k, v)
            if r.stack is not None:
                row.stack = r.stack


def settle(s: Session, job: Job, state: str, exits: Optional[dict[int, str]] = None,
           lost_agent: Optional[int] = None) -> None:
    """The attempt is over: each rank's exit column is filled. `exits` are what node rank 0's agent
    saw (exit code or signal from torchrun's summary, or the state each rank said); a rank it could
    not see (another node's) ended with the gang: 'stopped by gang', or its state when the job ended
    well. A lost agent's ranks say so."""
    exits = exits or {}
    for row in s.scalars(select(JobRank).where(JobRank.job_id == job.id, JobRank.attempt == job.attempt)):
        row.stack = None  # a stall's stacks were for the attempt's verdict, given by now
        if row.rank in exits:
            row.exit = str(exits[row.rank])[:200]
        elif row.exit is None:
            if lost_agent is not None and row.agent_id == lost_agent:
                row.exit = "lost with its agent"
            else:
                row.exit = state if state in ("completed", "paused") else "stopped by gang"
        # A job that completed ran every step on every rank; the rows hold each rank's last heartbeat,
        # a step or two short (297 and 298 of 300): the table ends where the job did.
        if state == "completed" and job.step is not None and (row.step is None or row.step < job.step):
            row.step = job.step


def gang_agents(s: Session, job: Job) -> set[int]:
    """The agents holding a share of a multi-node job (server/gang.py), none for a one-node job."""
    try:
        from server.gang import members
    except ImportError:
        return set()
    return set(members(s, job))


def table(s: Session, job_id: int) -> list[dict]:
    """The job's rank table (its newest attempt), rank order, with the age of each rank's last progress."""
    now = time.time()
    out = []
    for row in s.scalars(select(JobRank).where(JobRank.job_id == job_id).order_by(JobRank.rank)):
        d = {"rank": row.rank, "attempt": row.attempt, "agent_id": row.agent_id, "updated_at": row.updated_at,
             **{k: getattr(row, k) for k in COLUMNS}}
        d["progress_age_s"] = round(now - row.progress_at, 1) if row.progress_at else None
        out.append(d)
    return out


def stacks(s: Session, job_id: int) -> list[dict]:
    """The stacks other nodes' agents sent for the job's current attempt (a multi-node stall)."""
    job = s.get(Job, job_id)
    return [{"rank": row.rank, "host": row.host, "pid": row.pid, "agent_id": row.agent_id, "stack": row.stack}
            for row in s.scalars(select(JobRank).where(JobRank.job_id == job_id, JobRank.attempt == job.attempt,
                                                       JobRank.stack.is_not(None)).order_by(JobRank.rank))]


ASKED = ""  # a Slurm job's other nodes asked for their ranks' stacks: the row's stack until they arrive


def ask_other_nodes(s: Session, job: Job, ranks_per_node: int) -> int:
    """A Slurm job's node rank 0 on a stall (no gang members: the executor's agent holds every
    node's rows): the ranks past its own are marked asked; their node process's next heartbeat
    reply says `stack`. Returns how many ranks were asked."""
    return s.execute(update(JobRank).where(JobRank.job_id == job.id, JobRank.attempt == job.attempt,
                                           JobRank.rank >= ranks_per_node).values(stack=ASKED)).rowcount


def asked(s: Session, job_id: int, ranks: list[int]) -> bool:
    """Whether any of these ranks (one node's) is asked for its stack and has not sent it yet."""
    return s.scalar(select(func.count()).select_from(JobRank).where(
        JobRank.job_id == job_id, JobRank.rank.in_(ranks), JobRank.stack == ASKED)) > 0
