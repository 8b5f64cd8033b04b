"""Leases: an agent whose heartbeats stop is lost, and its jobs are handled by the retry policy
(requeued from their newest checkpoint, or failed) instead of being left 'running' forever.

An agent is lost after `agent_lost_after_s` without a heartbeat, counted from the later of its last
heartbeat and this server's start: a server restart gives every agent a full lease to reconnect
instead of failing all running jobs at once. The end of a database write stall (server/db.py
`stalled_at`) counts like a start: heartbeats that could not be stored are not the agents' fault.
Neither is the time this server's event loop stood still (heartbeats.LoopPauses): it is not counted.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from sqlalchemy import select

from server import store
from server.dialect import raw_cursor
from server.gang import lost_gangs
from server.hub import job_frames
from server.ingest.alerts import alert_dict, upsert_alert
from server.models import Agent, Job
from server.rules import RULES, Fired
from server.storage_errors import clear_outages
from tokenpulse.protocol import (
    ACTIVE_STATES,
    AGENTS_TOPIC,
    ALERT_FRAME,
    ALERTS_TOPIC,
    AlertKind,
    Failure,
    JobState,
    agent_frame,
    alert_frame,
)

log = logging.getLogger("tokenpulse.reaper")


def reap(s, lost_after_s: float, started_at: float = 0.0, now: Optional[float] = None,
         arriving: frozenset[int] = frozenset(), paused: Callable[[float], float] = lambda t: 0.0) -> list[tuple]:
    """arriving: agents whose message this server holds, not yet applied (heartbeats.Arriving): spared.
    paused(t): seconds this server's loop stood still since t (heartbeats.LoopPauses): not the agents'."""
    now = time.time() if now is None else now
    if now - started_at < lost_after_s:
        return []  # every agent gets one full lease after a server start
    frames = []
    for agent in s.scalars(select(Agent).where(Agent.state == "online", Agent.seen_at < now - lost_after_s)):
        if agent.id in arriving or now - agent.seen_at - paused(agent.seen_at) < lost_after_s:
            continue
        agent.state = "lost"
        frames.append((AGENTS_TOPIC, agent_frame({"id": agent.id, "state": "lost"}), False))
        jobs = list(s.scalars(select(Job).where(Job.agent_id == agent.id,
                                                Job.state.in_([x.value for x in ACTIVE_STATES]))))
        jobs += lost_gangs(s, agent.id)  # a multi-node job fails as a whole with any of its agents
        for job in jobs:
            silent = now - (agent.seen_at or 0)
            reason = (f"worker lost: agent {agent.name} sent no heartbeat for {silent:.0f} s "
                      f"(lost after {lost_after_s:g} s)")
            attempt = job.attempt
            new_state = store.end_attempt(s, job, JobState.failed, reason, Failure.LOST, lost_agent=agent.id)
            policy = (f"requeued after attempt {attempt} (resumes from its newest checkpoint)"
                      if new_state == JobState.queued else f"job {new_state.value}")
            alert = upsert_alert(s, job.id, agent.id, {"kind": AlertKind.WORKER_LOST, "severity": "critical",
                                                       "message": f"{reason}; {policy}"})
            frames.append((ALERTS_TOPIC, alert_frame(alert_dict(alert)), False))
            fired = Fired()
            RULES.state_changed(s, job, fired)  # "tell me when any job named sft-* fails": lost ones too
            frames += fired.frames
            frames += job_frames(store.job_summary(job))
            log.warning("job %s: %s -> %s", job.id, reason, new_state.value)
    return frames


def reaper_pass(s, tp, started_at: float) -> list[tuple]:
    """One pass. During a database write stall it also tries a write (which touches nothing): only a
    write ends a stall (server/db.py), so leases restart and the outage clears exactly when the
    database takes writes again, never on a read that slipped past another process's lock."""
    frames = reap(s, tp.settings.agent_lost_after_s, lease_origin(tp.db, started_at),
                  arriving=frozenset(tp.arriving.agents()), paused=tp.pauses.since)
    if tp.db.in_stall:
        raw_cursor(s).execute("UPDATE agents SET seen_at = seen_at WHERE id = -1")
    return frames


def lease_origin(db, started_at: float) -> float:
    """Where leases count from: the server's start, or the end of the latest database write stall
    (another process's lock, a full disk) if later. Heartbeats that arrived but could not be stored
    are the server's silence, not the agents': each gets a full lease after it, as after a start."""
    return max(started_at, db.stall_ended_at())


async def reaper_loop(tp, lock=None) -> None:
    """lock: a leader.ReaperLock where several server processes share one PostgreSQL: only the
    process holding it reaps."""
    started_at = time.time()
    while True:
        slept_at = time.monotonic()
        await asyncio.sleep(tp.settings.reaper_every_s)
        tp.pauses.note(time.monotonic() - slept_at - tp.settings.reaper_every_s)  # woke late: the loop stood still
        if lock is not None and not await lock.acquire():
            continue
        try:
            frames = await tp.db.write(lambda s: reaper_pass(s, tp, started_at))
            clear_outages(tp)  # a write went through (else in_stall holds it open): the outage is over
            tp.hub.publish_all(frames)
            if tp.webhooks is not None:
                tp.webhooks.send_all([p["alert"] for _, p, _ in frames if p["type"] == ALERT_FRAME])
        except Exception:  # the reaper must outlive any one bad pass
            log.exception("reaper pass failed")
