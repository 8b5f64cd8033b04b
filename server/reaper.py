"""Leases: an agent whose heartbeats stop is lost, and its jobs are handled by the retry policy
(requeued from their newest checkpoint, or failed) instead of being left 'running' forever."""
from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy import select

from server import store
from server.ingest import alert_dict, upsert_alert
from server.models import Agent, Job
from tokenpulse.protocol import ACTIVE_STATES

log = logging.getLogger("tokenpulse.reaper")


def reap(s, lost_after_s: float) -> list[tuple]:
    now = time.time()
    frames = []
    for agent in s.scalars(select(Agent).where(Agent.state == "online", Agent.seen_at < now - lost_after_s)):
        agent.state = "lost"
        frames.append(("agents", {"type": "agent", "agent": {"id": agent.id, "state": "lost"}}, False))
        jobs = s.scalars(select(Job).where(Job.agent_id == agent.id,
                                           Job.state.in_([x.value for x in ACTIVE_STATES])))
        for job in jobs:
            silent = now - agent.seen_at
            reason = f"worker lost: agent {agent.name} sent no heartbeat for {silent:.0f} s"
            alert = upsert_alert(s, job.id, agent.id, {"kind": "worker_lost", "severity": "critical",
                                                       "message": reason})
            new_state = store.end_attempt(s, job, store.JobState.failed, reason, "lost")
            frames.append(("alerts", {"type": "alert", "alert": alert_dict(alert)}, False))
            frames.append(("jobs", {"type": "job", "job": store.job_summary(job)}, False))
            frames.append((f"job:{job.id}", {"type": "job", "job": store.job_summary(job)}, False))
            log.warning("job %s: %s -> %s", job.id, reason, new_state.value)
    return frames


async def reaper_loop(tp) -> None:
    while True:
        await asyncio.sleep(tp.settings.reaper_every_s)
        try:
            frames = await tp.db.write(lambda s: reap(s, tp.settings.agent_lost_after_s))
            for topic, payload, droppable in frames:
                tp.hub.publish(topic, payload, droppable)
                if payload.get("type") == "alert" and tp.webhooks is not None:
                    tp.webhooks.send(payload["alert"])
        except Exception:  # the reaper must outlive any one bad pass
            log.exception("reaper pass failed")
