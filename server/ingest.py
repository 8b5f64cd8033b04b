"""Agent event batches -> one transaction per batch -> live frames for the hub.

Runs on the writer thread. Exactly once: each job keeps a watermark (next_seq); events below it are
replays and are acknowledged without being stored again. Metrics go to the lean metrics table in
one executemany; everything else to the events table.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from server import store
from server.models import Agent, Alert, Event as EventRow, Job, MetricKey
from tokenpulse.protocol import ACTIVE_STATES, Command, Event, JobState


@dataclass
class Outcome:
    acked: dict[int, int] = field(default_factory=dict)
    commands: list[Command] = field(default_factory=list)
    frames: list[tuple[str, dict, bool]] = field(default_factory=list)  # (topic, payload, droppable)
    alerts: list[dict] = field(default_factory=list)  # new or changed alerts, for webhooks


class MetricKeys:
    """name -> id, cached: key names are few, points are many."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def id_for(self, s: Session, name: str) -> int:
        kid = self.ids.get(name)
        if kid is None:
            kid = s.scalar(select(MetricKey.id).where(MetricKey.name == name))
            if kid is None:
                kid = s.execute(insert(MetricKey).values(name=name).returning(MetricKey.id)).scalar_one()
            self.ids[name] = kid
        return kid

    def names(self, s: Session) -> dict[int, str]:
        return {kid: name for kid, name in s.execute(select(MetricKey.id, MetricKey.name))}


METRIC_KEYS = MetricKeys()

INSERT_METRIC = "INSERT OR REPLACE INTO metrics (job_id, key_id, step, t, value) VALUES (?, ?, ?, ?, ?)"


def ingest(s: Session, agent_id: int, events: list[Event]) -> Outcome:
    out = Outcome()
    by_job: dict[int, list[Event]] = defaultdict(list)
    for ev in events:
        by_job[ev.job_id].append(ev)
    metric_rows: list[tuple] = []
    event_rows: list[dict] = []
    for job_id, evs in by_job.items():
        job = s.get(Job, job_id)
        evs.sort(key=lambda e: e.seq)
        if job is None:
            out.acked[job_id] = evs[-1].seq  # nothing to store them in; let the agent forget them
            out.commands.append(Command(job_id=job_id, action="cancel"))
            continue
        fresh = [e for e in evs if e.seq >= job.next_seq]
        if job.agent_id != agent_id or JobState(job.state) not in ACTIVE_STATES:
            # A stale agent (its job was reassigned or is over): acknowledge, store nothing, stop it.
            out.acked[job_id] = evs[-1].seq
            if any(e.kind != "state" for e in fresh) and JobState(job.state) != JobState.paused:
                out.commands.append(Command(job_id=job_id, action="cancel"))
            continue
        out.acked[job_id] = max(evs[-1].seq, job.next_seq - 1)
        if not fresh:
            continue
        job.next_seq = fresh[-1].seq + 1
        if job.state == JobState.starting.value:
            store.transition(s, job, JobState.running)
        live: list[dict] = []
        for e in fresh:
            d = e.data
            if e.kind == "metrics":
                step = d["step"]
                for name, value in d["values"].items():
                    metric_rows.append((job_id, METRIC_KEYS.id_for(s, name), step, e.t, value))
                job.step = step
                last = json.loads(job.last) if job.last else {}
                last.update(d["values"])
                last["step"] = step
                job.last = json.dumps(last)
            else:
                event_rows.append({"job_id": job_id, "seq": e.seq, "t": e.t, "kind": e.kind,
                                   "data": json.dumps(d)})
                apply_event(s, job, e, out)
            live.append({"kind": e.kind, "seq": e.seq, "t": e.t, "data": d})
        critical = any(x["kind"] in ("state", "alert") for x in live)
        out.frames.append((f"job:{job_id}", {"type": "events", "job_id": job_id, "events": live},
                           not critical))
        out.frames.append(("jobs", {"type": "job", "job": store.job_summary(job)}, not critical))
    if metric_rows:
        # One executemany on the raw DBAPI cursor: ~10x cheaper per row than ORM objects.
        s.connection().exec_driver_sql(INSERT_METRIC, metric_rows)
    if event_rows:
        s.execute(insert(EventRow).prefix_with("OR IGNORE"), event_rows)
    return out


def apply_event(s: Session, job: Job, e: Event, out: Outcome) -> None:
    d = e.data
    if e.kind == "phase":
        job.phase = json.dumps(d)
        if d.get("name") == "training" and d.get("total"):
            job.total_steps = int(d["total"])
            if d.get("done") is not None:
                job.step = int(d["done"])
    elif e.kind == "state":
        state = JobState(d["state"])
        store.end_attempt(s, job, state, d.get("reason"), d.get("failure"), d.get("exit_code"),
                          d.get("signal"), d.get("retry", False))
    elif e.kind == "checkpoint":
        if d.get("final"):
            job.output_dir = d["path"]
        else:
            job.checkpoint = d["path"]
    elif e.kind == "info":
        info = json.loads(job.info) if job.info else {}
        info.update(d)
        job.info = json.dumps(info)
    elif e.kind == "alert":
        alert = upsert_alert(s, job.id, job.agent_id, d)
        if alert is not None:
            payload = alert_dict(alert)
            out.alerts.append(payload)
            out.frames.append(("alerts", {"type": "alert", "alert": payload}, False))


def upsert_alert(s: Session, job_id: Optional[int], agent_id: Optional[int], d: dict) -> Optional[Alert]:
    """One open alert per (job, kind): a repeat updates it, a clear closes it and says so."""
    now = time.time()
    current = s.scalar(select(Alert).where(Alert.job_id == job_id, Alert.kind == d["kind"],
                                           Alert.state != "cleared").order_by(Alert.id.desc()).limit(1))
    if d.get("clear"):
        if current is None:
            return None
        current.state, current.cleared_at, current.updated_at = "cleared", now, now
        current.message = f"{current.message}\nCleared: {d['message']}"
        return current
    if current is not None:
        current.message, current.severity, current.updated_at = d["message"], d.get("severity", "warning"), now
        if d.get("stack"):
            current.stack = d["stack"]
        return current
    alert = Alert(job_id=job_id, agent_id=agent_id, kind=d["kind"], severity=d.get("severity", "warning"),
                  state="open", message=d["message"], stack=d.get("stack"), created_at=now, updated_at=now)
    s.add(alert)
    s.flush()
    return alert


def alert_dict(a: Alert) -> dict:
    return {"id": a.id, "job_id": a.job_id, "agent_id": a.agent_id, "kind": a.kind, "severity": a.severity,
            "state": a.state, "message": a.message, "stack": a.stack, "created_at": a.created_at,
            "updated_at": a.updated_at, "cleared_at": a.cleared_at}


def pending_commands(s: Session, agent_id: int, job_ids: list[int]) -> list[Command]:
    """Commands for an agent: requested actions on its jobs, and 'cancel' for jobs it runs that are
    no longer its own (reassigned after a lost lease, or deleted)."""
    cmds = []
    for job in s.scalars(select(Job).where(Job.agent_id == agent_id, Job.requested_action.is_not(None))):
        cmds.append(Command(job_id=job.id, action=job.requested_action))
        if job.requested_action == "stack":
            job.requested_action = None  # one-shot
    mine = {c.job_id for c in cmds}
    for jid in job_ids:
        if jid in mine:
            continue
        job = s.get(Job, jid)
        if job is None or job.agent_id != agent_id:
            cmds.append(Command(job_id=jid, action="cancel"))
    return cmds


def heartbeat(s: Session, agent_id: int, jobs: dict[int, float]) -> tuple[list[Command], list[tuple]]:
    """The agent is alive; so are the jobs whose training process said so at the given times."""
    now = time.time()
    frames = []
    s.execute(update(Agent).where(Agent.id == agent_id).values(seen_at=now, state="online"))
    for jid, alive_t in jobs.items():
        job = s.get(Job, jid)
        if job is not None and job.agent_id == agent_id:
            job.alive_at = alive_t
            frames.append((f"job:{jid}", {"type": "heartbeat", "job_id": jid, "t": now, "alive_at": alive_t}, True))
            frames.append(("jobs", {"type": "heartbeat", "job_id": jid, "t": now, "alive_at": alive_t}, True))
    return pending_commands(s, agent_id, list(jobs)), frames
