"""An agent is alive (and so are the jobs it reports); the commands waiting for it.

Raw SQL on the indexed jobs.agent_id throughout: this runs on every heartbeat and event batch, and
100 agents beating every 2 s must cost next to nothing (the ORM cost ~0.3 ms a call)."""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import Iterable, Optional

from sqlalchemy.orm import Session

from server.dialect import raw_cursor
from tokenpulse.protocol import JOBS_TOPIC, Action, Command, heartbeat_frame, job_topic


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


class Arriving:
    """Agents with a message (a heartbeat, an event batch) received by this server process and not
    yet applied: on a busy server it can wait on the writer behind other writes for longer than a
    lease. The reaper spares them: the delay is the server's, not the agent's (an agent uploading a
    big backlog was declared lost while its own heartbeat sat in the queue). Per process, like
    Deliveries; on the event loop only."""

    def __init__(self):
        self.count: dict[int, int] = {}

    def add(self, agent_id: int) -> None:
        self.count[agent_id] = self.count.get(agent_id, 0) + 1

    def done(self, agent_id: int) -> None:
        left = self.count.get(agent_id, 1) - 1
        if left > 0:
            self.count[agent_id] = left
        else:
            self.count.pop(agent_id, None)

    @contextmanager
    def held(self, agent_id: Optional[int]):
        """Around an HTTP route's write; None (a job's own credential: no lease of the agent's) holds nothing."""
        if agent_id is None:
            yield
            return
        self.add(agent_id)
        try:
            yield
        finally:
            self.done(agent_id)

    def agents(self) -> set[int]:
        return set(self.count)


class LoopPauses:
    """Stretches this server process's event loop could not run (the reaper's sleep woke late: a long
    synchronous stretch, a machine too busy to schedule it). Agents' messages wait unread in their
    sockets meanwhile: that silence is the server's, and the reaper does not count it against a
    lease (an agent was declared lost on a loaded machine while its heartbeat sat unread)."""

    MIN_S = 0.25  # scheduling jitter below this is not counted
    KEEP_S = 3600.0

    def __init__(self):
        self.pauses: deque[tuple[float, float]] = deque()  # (wall time it ended, seconds)

    def note(self, late_s: float, now: Optional[float] = None) -> None:
        if late_s < self.MIN_S:
            return
        now = time.time() if now is None else now
        self.pauses.append((now, late_s))
        while now - self.pauses[0][0] > self.KEEP_S:
            self.pauses.popleft()

    def since(self, t: float) -> float:
        """Seconds of pause after wall time t."""
        return sum(min(s, end - t) for end, s in self.pauses if end > t)


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


def heartbeat_many(s: Session, beats: dict[int, dict[int, float]], owner: dict[int, Optional[int]],
                   asking: Iterable[int] = (), heard: Iterable[int] = ()
                   ) -> tuple[dict[int, list[Command]], list[tuple]]:
    """Many agents' heartbeats in a few statements (server/agent_protocol.py, one agent's over HTTP
    or a whole websocket gathering's): each agent and the jobs it names are alive; the commands
    waiting for it (pending_commands, each statement run once for all).
    owner: job id -> its agent, as the session holds the jobs now (every job the beats name).
    asking: agents that sent events without a heartbeat: their commands too, no job marked alive.
    heard: those of them that sent the events themselves (not a job's own credential): the agent
    process is up, so its lease is renewed as by a heartbeat (a heartbeat due while its batches
    queued behind each other on a busy machine must not make an agent that is delivering lost)."""
    now = time.time()
    frames: list[tuple] = []
    cur = raw_cursor(s)
    agents = list(dict.fromkeys([*beats, *asking]))
    alive = list(dict.fromkeys([*beats, *heard]))
    if alive:
        cur.executemany("UPDATE agents SET seen_at = ?, state = 'online' WHERE id = ?", [(now, a) for a in alive])
    rows = [(alive_t, jid, aid) for aid, jobs in beats.items() for jid, alive_t in jobs.items()
            if owner.get(jid) == aid]
    if rows:
        cur.executemany("UPDATE jobs SET alive_at = ? WHERE id = ? AND agent_id = ?", rows)
    for alive_t, jid, _ in rows:
        frame = heartbeat_frame(jid, now, alive_t)
        frames += [(job_topic(jid), frame, True), (JOBS_TOPIC, frame, True)]
    cmds: dict[int, list[Command]] = {aid: [] for aid in agents}
    if not agents:
        return cmds, frames
    stacks = []
    for jid, aid, action, stack_at in cur.execute(
            "SELECT id, agent_id, requested_action, stack_requested_at FROM jobs WHERE agent_id IN "
            f"({', '.join('?' * len(agents))}) AND (requested_action IS NOT NULL OR stack_requested_at IS NOT NULL)",
            agents).fetchall():
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


def queued_work(s: Session) -> bool:
    """Whether any job waits to be claimed (the jobs.state index: one probe for a whole gathering)."""
    return raw_cursor(s).execute("SELECT 1 FROM jobs WHERE state = 'queued' LIMIT 1").fetchone() is not None
