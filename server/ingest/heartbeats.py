"""An agent is alive (and so are the jobs it reports); the commands waiting for it.

Raw SQL on the indexed jobs.agent_id throughout: this runs on every heartbeat and event batch, and
100 agents beating every 2 s must cost next to nothing (the ORM cost ~0.3 ms a call)."""
from __future__ import annotations

import time
from typing import Optional

from sqlalchemy.orm import Session

from server.dialect import raw_cursor
from server.hub import job_topic
from tokenpulse.protocol import Action, Command, heartbeat_frame


class Deliveries:
    """When each job's agent last delivered events for it to this server process (stored or replayed):
    an agent still uploading a job's backlog is still running that job, even where its heartbeats do
    not list it (store.reconcile spares it). Touched only on the writer thread; per process (on
    PostgreSQL with several processes the agent's heartbeats listing the job are what counts)."""

    KEEP_S = 3600.0

    def __init__(self):
        self.at: dict[int, float] = {}

    def note(self, job_ids) -> None:
        now = time.time()
        for jid in job_ids:
            self.at[jid] = now
        if len(self.at) > 10_000:  # finished jobs' entries must not pile up
            self.at = {j: t for j, t in self.at.items() if now - t < self.KEEP_S}

    def get(self, job_id: int, default: float = 0.0) -> float:
        return self.at.get(job_id, default)


def pending_commands(s: Session, agent_id: int, job_ids: list[int]) -> list[Command]:
    """Commands for an agent: requested actions on its jobs, and 'cancel' for jobs it runs that are
    no longer its own (reassigned after a lost lease, or deleted)."""
    cur = raw_cursor(s)  # sqlite3's, or psycopg's taking `?` too
    cmds, stacks = [], []
    for jid, action, stack_at in cur.execute(
            "SELECT id, requested_action, stack_requested_at FROM jobs WHERE agent_id = ? "
            "AND (requested_action IS NOT NULL OR stack_requested_at IS NOT NULL)", (agent_id,)).fetchall():
        if action is not None:
            cmds.append(Command(job_id=jid, action=action))
        if stack_at is not None:
            cmds.append(Command(job_id=jid, action=Action.STACK))
            stacks.append((jid,))
    if stacks:  # one-shot: handed out once
        cur.executemany("UPDATE jobs SET stack_requested_at = NULL WHERE id = ?", stacks)
    mine = {c.job_id for c in cmds}
    others = [jid for jid in job_ids if jid not in mine]
    if others:
        owner = dict(cur.execute(f"SELECT id, agent_id FROM jobs WHERE id IN ({', '.join('?' * len(others))})",
                                 others).fetchall())
        cmds.extend(Command(job_id=jid, action=Action.CANCEL) for jid in others if owner.get(jid) != agent_id)
    return cmds


def heartbeat(s: Session, agent_id: int, jobs: dict[int, float]) -> tuple[list[Command], list[tuple]]:
    """The agent is alive; so are the jobs whose training process said so at the given times."""
    now = time.time()
    frames = []
    cur = raw_cursor(s)  # sqlite3's, or psycopg's taking `?` too
    cur.execute("UPDATE agents SET seen_at = ?, state = 'online' WHERE id = ?", (now, agent_id))
    for jid, alive_t in jobs.items():
        cur.execute("UPDATE jobs SET alive_at = ? WHERE id = ? AND agent_id = ?", (alive_t, jid, agent_id))
        if cur.rowcount:
            frame = heartbeat_frame(jid, now, alive_t)
            frames.append((job_topic(jid), frame, True))
            frames.append(("jobs", frame, True))
    return pending_commands(s, agent_id, list(jobs)), frames


def heartbeat_many(s: Session, beats: dict[int, dict[int, float]], owner: dict[int, Optional[int]]
                   ) -> tuple[dict[int, list[Command]], list[tuple]]:
    """Many agents' heartbeats in a few statements (agent websockets' gatherings, agent_channel.py):
    what heartbeat() and pending_commands() do for one, with each statement run once for all.
    owner: job id -> its agent, as the session holds the jobs now (every job the beats name)."""
    now = time.time()
    frames: list[tuple] = []
    cur = raw_cursor(s)
    cur.executemany("UPDATE agents SET seen_at = ?, state = 'online' WHERE id = ?", [(now, a) for a in beats])
    rows = [(alive_t, jid, aid) for aid, jobs in beats.items() for jid, alive_t in jobs.items()
            if owner.get(jid) == aid]
    if rows:
        cur.executemany("UPDATE jobs SET alive_at = ? WHERE id = ? AND agent_id = ?", rows)
    for alive_t, jid, _ in rows:
        frame = heartbeat_frame(jid, now, alive_t)
        frames += [(job_topic(jid), frame, True), ("jobs", frame, True)]
    cmds: dict[int, list[Command]] = {aid: [] for aid in beats}
    stacks = []
    for jid, aid, action, stack_at in cur.execute(
            "SELECT id, agent_id, requested_action, stack_requested_at FROM jobs WHERE agent_id IN "
            f"({', '.join('?' * len(beats))}) AND (requested_action IS NOT NULL OR stack_requested_at IS NOT NULL)",
            list(beats)).fetchall():
        if action is not None:
            cmds[aid].append(Command(job_id=jid, action=action))
        if stack_at is not None:
            cmds[aid].append(Command(job_id=jid, action=Action.STACK))
            stacks.append((jid,))
    if stacks:  # one-shot: handed out once
        cur.executemany("UPDATE jobs SET stack_requested_at = NULL WHERE id = ?", stacks)
    for aid, jobs in beats.items():  # jobs it runs that are no longer its own: cancel
        mine = {c.job_id for c in cmds[aid]}
        cmds[aid] += [Command(job_id=jid, action=Action.CANCEL) for jid in jobs
                      if jid not in mine and owner.get(jid) != aid]
    return cmds, frames
