"""The agent protocol's one handler: agents' heartbeats (rank rows included) and event batches,
applied and answered the same whichever way they came.

- apply_messages: a list of messages (one over HTTP: server/api/agents.py; a whole gathering of
  many agents' over their websockets: server/agent_channel.py), in ONE writer transaction: the
  jobs they touch loaded in one query, the batches stored, then every heartbeat at once; each
  message gets its AgentReply (acks, commands, and "work" while a job waits to be claimed).
- after_ingest: what follows any stored batch once the transaction committed (the live frames,
  the /metrics counters, webhooks and rules' channels), for the agents' routes, the agent socket
  and the external jobs' route (server/api/external.py) alike.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from sqlalchemy import or_, select

from server import gang, ranks, store
from server.dialect import raw_cursor
from server.hub import job_frames
from server.ingest import apply, heartbeats
from server.models import Job
from server.reaper import lease_origin
from server.rules import RULES
from tokenpulse.protocol import (
    ACTIVE_STATES,
    JOBS_TOPIC,
    WORK_TOPIC,
    Action,
    AgentReply,
    Command,
    Heartbeat,
    JobState,
    work_frame,
)


@dataclass
class Incoming:
    """One agent's message, checked: its heartbeat and/or its batch's events (ingest/parse.py)."""
    agent_id: int
    heartbeat: Optional[Heartbeat] = None
    events: Optional[list] = None
    # sent with a job's own credential (a Slurm node process): its heartbeat names only that job,
    # so it settles nothing else of the agent's (reconcile), and it is answered for that job alone
    job_only: Optional[int] = None


@dataclass
class Applied:
    replies: list[AgentReply]  # one per message, in order
    outcome: apply.Outcome = field(default_factory=apply.Outcome)  # for after_ingest: frames, alerts, counts


def apply_messages(s, tp, messages: list[Incoming]) -> Applied:
    """Apply agents' messages in the writer's session (the caller checked who sent them)."""
    jobs = _load_jobs(s, messages)
    total = apply.Outcome()
    replies = []
    # several batches: their event rows go in one statement after the loop (on PostgreSQL a
    # statement per batch was most of a gathering's cost); one batch may be stored in committed
    # chunks (the bulk lane), each with its own rows
    deferred = len(messages) > 1
    if deferred:
        s.info["event_rows"] = event_rows = []
    try:
        for m in messages:
            reply = AgentReply()
            if m.events is not None:
                out = apply.ingest(s, m.agent_id, m.events, tp.hub)
                tp.deliveries.note(out.delivered)
                _add(total, out)
                reply.acked, reply.commands = out.acked, list(out.commands)
            replies.append(reply)
    finally:
        s.info.pop("event_rows", None)
    if deferred and event_rows:
        apply.store_event_rows(s, event_rows)
    # then every heartbeat at once (a few statements, not a few per agent), against the jobs as the
    # batches above left them
    beats: dict[int, dict[int, float]] = {}
    reported: dict[int, set[int]] = {}  # per agent: what its own heartbeats say it runs or holds
    for m in messages:
        if m.heartbeat is not None:
            beats.setdefault(m.agent_id, {}).update(m.heartbeat.jobs)
            if m.job_only is None:
                reported.setdefault(m.agent_id, set()).update(m.heartbeat.jobs, m.heartbeat.held)
    asking = [m.agent_id for m in messages if m.heartbeat is None]
    heard = [m.agent_id for m in messages if m.heartbeat is None and m.job_only is None]
    s.flush()  # the raw statements below must see what the batches changed
    commands, frames = heartbeats.heartbeat_many(s, beats, {job.id: job.agent_id for job in jobs}, asking,
                                                 heard)
    total.frames += frames
    for m in messages:
        if m.heartbeat is not None and m.heartbeat.ranks:
            commands[m.agent_id] += _rank_commands(s, m.agent_id, m.heartbeat, m.job_only is not None)
    if beats:
        origin = lease_origin(tp.db, tp.started_at)
        held: dict[int, list[Job]] = {}
        active = {x.value for x in ACTIVE_STATES}
        for job in jobs:
            if job.agent_id in beats and job.state in active:
                held.setdefault(job.agent_id, []).append(job)
        for agent_id, said in reported.items():
            for job in store.reconcile(s, agent_id, said, tp.settings.agent_lost_after_s, origin,
                                       held.get(agent_id, []), tp.deliveries):
                RULES.state_changed(s, job, total)  # failed without a report of its own: state rules see it
                total.frames += job_frames(store.job_summary(job))
    work = bool(beats) and heartbeats.queued_work(s)
    rearm: list[int] = []
    for m, reply in zip(messages, replies):
        have = {(c.job_id, c.action) for c in reply.commands}
        reply.commands += [c for c in commands[m.agent_id] if (c.job_id, c.action) not in have]
        if m.job_only is not None or (m.heartbeat is not None and m.heartbeat.held):
            rearm += _not_for(m, reply)
        reply.work = work and m.heartbeat is not None and m.job_only is None
    if rearm:  # a stack request is one-shot: one the message's sender cannot take waits for its taker
        raw_cursor(s).executemany("UPDATE jobs SET stack_requested_at = ? WHERE id = ?",
                                  [(time.time(), jid) for jid in rearm])
    s.info.pop("locked", None)
    return Applied(replies, total)


def _not_for(m: Incoming, reply: AgentReply) -> list[int]:
    """Commands not for this message's sender dropped from its reply: a job credential's are its
    job's alone; a stack request for a job whose node process reports for it (`held`) is that
    process's to take. Returns the jobs whose stack request must wait for its taker."""
    def mine(c: Command) -> bool:
        if m.job_only is not None:
            return c.job_id == m.job_only
        return not (c.action == Action.STACK and m.heartbeat is not None and c.job_id in m.heartbeat.held)
    dropped = [c for c in reply.commands if not mine(c)]
    reply.commands = [c for c in reply.commands if mine(c)]
    return [c.job_id for c in dropped if c.action == Action.STACK]


def _load_jobs(s, messages: list[Incoming]) -> list[Job]:
    """Every job these messages name, and every active job of the agents that beat, in one query:
    later lookups hit the session's identity map (the caller holds the list: the map keeps only
    referenced objects). On PostgreSQL locked, in one order for every process."""
    job_ids = {e.job_id for m in messages if m.events for e in m.events}
    job_ids.update(jid for m in messages if m.heartbeat is not None for jid in m.heartbeat.jobs)
    beating = {m.agent_id for m in messages if m.heartbeat is not None}
    if not job_ids and not beating:
        return []
    active = [x.value for x in ACTIVE_STATES]
    query = select(Job).where(or_(Job.id.in_(job_ids), Job.agent_id.in_(beating) & Job.state.in_(active)))
    query = query.order_by(Job.id)
    if s.get_bind().dialect.name == "postgresql":  # what ingest would lock job by job (apply.py)
        query = query.with_for_update()
    jobs = list(s.scalars(query))
    s.info["locked"] = {job.id for job in jobs}
    return jobs


def _rank_commands(s, agent_id: int, hb: Heartbeat, job_credential: bool = False) -> list[Command]:
    """A distributed job's rank table stored; and for a share on node rank > 0 (a job it runs whose
    node rank 0 is another agent's): stop its ranks if the gang is over (node rank 0's agent lost),
    read their stacks if node rank 0's agent asked (a stall). A Slurm node process (a job's own
    credential, valid only while its attempt is) is no gang member: its rank rows are all there is."""
    ranks.store(s, agent_id, hb.ranks)
    if job_credential:  # a Slurm node process: asked through its rank rows (ranks.ask_other_nodes)
        return [Command(job_id=j, action=Action.STACK) for j, rows in hb.ranks.items()
                if j not in hb.jobs and ranks.asked(s, j, [r.rank for r in rows])]
    shares = [j for j in hb.ranks if j not in hb.jobs]
    return ([Command(job_id=j, action=Action.CANCEL) for j in gang.stale_shares(s, agent_id, shares)]
            + [Command(job_id=j, action=Action.STACK) for j in gang.stack_requests(s, agent_id, shares)])


def _add(total: apply.Outcome, out: apply.Outcome) -> None:
    total.frames += out.frames
    total.alerts += out.alerts
    total.stored_events += out.stored_events
    total.stored_points += out.stored_points
    total.rule_work += out.rule_work


def after_ingest(tp, out: apply.Outcome) -> None:
    """On the event loop, once the transaction committed: the live frames to the hub, the counters
    for /metrics, and each new or changed alert to the webhooks (a rule's own channels among them)."""
    tp.stats.ingested_events += out.stored_events
    tp.stats.ingested_points += out.stored_points
    tp.hub.publish_all(out.frames)
    if tp.sweeps is not None:  # a sweep's trial: its objective's points feed the pruner, its end the next trial
        tp.sweeps.wake(out.acked)
    if any(_requeued(f) for f in out.frames):
        tp.hub.publish(WORK_TOPIC, work_frame(), droppable=True)  # requeued (a fix, a retry): claimed now
    if out.alerts and tp.webhooks is not None:
        tp.webhooks.send_all(out.alerts)
    if out.rule_work and tp.rule_runner is not None:
        tp.rule_runner.submit(out.rule_work)  # metric rules, judged now that the batch is stored


def _requeued(frame: tuple) -> bool:
    """A frame saying a job went back to the queue (an applied fix, a retry, an agent's stop)."""
    topic, payload = frame[0], frame[1]
    payload = getattr(payload, "payload", payload)
    return topic == JOBS_TOPIC and isinstance(payload, dict) and \
        (payload.get("job") or {}).get("state") == JobState.queued.value
