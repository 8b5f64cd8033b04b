"""A checked batch -> one transaction: per-job watermarks, metric points stored, other events
applied to their jobs (phase, state through the retry policy, checkpoint, info, alert), and the
live frames for the hub.

Metrics go to the lean metrics table (metrics.py); everything else to the events table.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

from sqlalchemy import update
from sqlalchemy.orm import Session

from server import fixes, store
from server.dialect import dialect_name, raw_cursor
from server.hub import Frame
from server.ingest.alerts import alert_dict, upsert_alert
from server.ingest.logcap import BUDGET as LOG_BUDGET
from server.ingest.metric_names import NAMES
from server.ingest.metrics import PointBatch
from server.ingest.parse import INT_LIMIT, Ev
from server.models import Attempt, Job
from server.rules import KIND_PREFIX, NON_FINITE_ALERT, RULES, JobRef
from tokenpulse.protocol import (
    ACTIVE_STATES,
    ALERTS_TOPIC,
    EXTERNAL,
    JOBS_TOPIC,
    NONFINITE_WORDS,
    Action,
    Command,
    JobState,
    Phase,
    alert_frame,
    events_frame,
    job_frame,
    job_topic,
    metric_wire,
)

INSERT_EVENT = "INSERT OR IGNORE INTO events (job_id, seq, t, kind, data) VALUES (?, ?, ?, ?, ?)"
PG_INSERT_EVENT = INSERT_EVENT.replace(" OR IGNORE", "") + " ON CONFLICT (job_id, seq) DO NOTHING"
CHUNK_POINTS = 1000  # a big batch is stored in chunks of about this many points


@dataclass
class Outcome:
    acked: dict[int, int] = field(default_factory=dict)
    commands: list[Command] = field(default_factory=list)
    frames: list[tuple[str, Any, bool]] = field(default_factory=list)  # (topic, payload or Frame, droppable)
    alerts: list[dict] = field(default_factory=list)  # new or changed alerts, for webhooks
    live: dict[int, list] = field(default_factory=dict)  # job id -> [stored events, critical?, Job]
    stored_events: int = 0  # new events stored (replays not counted), for /metrics
    stored_points: int = 0  # metric points among them
    delivered: set[int] = field(default_factory=set)  # active jobs of this agent it sent events for
    rule_work: list = field(default_factory=list)  # (JobRef, [(step, values)]) for server/rule_runner.py


def ingest(s: Session, agent_id: int, events: list, hub=None) -> Outcome:
    """Store a batch (Ev or protocol.Event objects). With a hub, live frames are built (serialized)
    here on the writer thread, and only for topics someone watches.

    A big batch goes in chunks of ~CHUNK_POINTS points, each committed (watermark included) before
    the writer runs the small writes queued meanwhile (db.Database._yield): a heartbeat, a state
    change or a live metric then waits for ~1,000 points (a few ms), not a 20,000-point batch.
    Exactly once still: if a later chunk fails, the agent sends the batch again and the committed
    chunks are replays."""
    yield_ = s.info.get("yield")
    if yield_ is not None and len(events) > CHUNK_POINTS // 16:
        # each job's events in seq order across chunks (the watermark of a chunk must not skip
        # a lower seq of the next one); a real agent sends them so already
        events = sorted(events, key=lambda e: (e.job_id, e.seq))
    chunks, chunk, size = [], [], 0
    for e in events:
        chunk.append(e)
        size += len(e.data["values"]) if e.kind == "metrics" else 1
        if size >= CHUNK_POINTS:
            chunks.append(chunk)
            chunk, size = [], 0
    if chunk:
        chunks.append(chunk)
    if yield_ is None or len(chunks) < 2:
        return live_frames(ingest_chunk(s, agent_id, events), hub)
    out = Outcome()
    for i, chunk in enumerate(chunks):
        if i:
            yield_()
            s.info.pop("locked", None)  # the commit released the rows the caller had locked
        part = ingest_chunk(s, agent_id, chunk)
        for job_id, seq in part.acked.items():
            out.acked[job_id] = max(seq, out.acked.get(job_id, seq))
        out.commands.extend(c for c in part.commands if c not in out.commands)
        out.stored_events += part.stored_events
        out.stored_points += part.stored_points
        out.delivered |= part.delivered
        out.frames.extend(part.frames)
        out.alerts.extend(part.alerts)
        out.rule_work.extend(part.rule_work)
        for job_id, (live, critical, job) in part.live.items():
            had = out.live.setdefault(job_id, [[], False, job])
            had[0].extend(live)
            had[1], had[2] = had[1] or critical, job
    return live_frames(out, hub)


def live_frames(out: Outcome, hub=None) -> Outcome:
    """One events frame and one summary per job and batch (not per chunk), serialized here on the
    writer thread, and only for topics someone watches."""
    watched = hub.watched if hub is not None else (lambda topic: True)
    for job_id, (live, critical, job) in out.live.items():
        topic = job_topic(job_id)
        if watched(topic):
            out.frames.append((topic, Frame(events_frame(job_id, live), not critical), not critical))
        if watched(JOBS_TOPIC):
            out.frames.append((JOBS_TOPIC, Frame(job_frame(store.job_summary(job)), not critical),
                               not critical))
    return out


def ingest_chunk(s: Session, agent_id: int, events: list) -> Outcome:
    out = Outcome()
    by_job: dict[int, list] = defaultdict(list)
    for ev in events:
        by_job[ev.job_id].append(ev)
    points = PointBatch()
    event_rows: list[tuple] = []
    pg = dialect_name(s) == "postgresql"
    RULES.refresh(s)  # alert rules people wrote (server/rules.py): in memory, reloaded after a change
    for job_id, evs in by_job.items():
        # PostgreSQL: the row stays locked to this transaction, so two server processes storing
        # batches of one job (an agent that switched servers) never both pass its watermark.
        # (the agent channel loads and locks a whole gathering's jobs in one query: s.info["locked"])
        locked = pg and job_id not in s.info.get("locked", ())
        job = s.get(Job, job_id, with_for_update=True if locked else None)
        evs.sort(key=lambda e: e.seq)
        if job is None:
            out.acked[job_id] = evs[-1].seq  # nothing to store them in; let the agent forget them
            out.commands.append(Command(job_id=job_id, action=Action.CANCEL))
            continue
        fresh = [e for e in evs if e.seq >= job.next_seq]
        if job.agent_id != agent_id or JobState(job.state) not in ACTIVE_STATES:
            # A stale agent (its job was reassigned or is over): acknowledge, store nothing, stop it.
            out.acked[job_id] = evs[-1].seq
            if any(e.kind != "state" for e in fresh) and JobState(job.state) != JobState.paused:
                out.commands.append(Command(job_id=job_id, action=Action.CANCEL))
            continue
        out.acked[job_id] = max(evs[-1].seq, job.next_seq - 1)
        out.delivered.add(job_id)
        if not fresh:
            continue
        job.next_seq = fresh[-1].seq + 1
        # a rule's alert is the server's alone (server/rules.py): a run cannot speak for someone's rule
        fresh = [e for e in fresh if not (e.kind == "alert" and str(e.data.get("kind", "")).startswith(KIND_PREFIX))]
        out.stored_events += len(fresh)
        state_before = job.state
        by_metric, state_rules = RULES.for_job(job) if RULES.rules else (None, None)
        if job.state == JobState.starting.value and not all(slurm_pending(e) for e in fresh):
            store.transition(s, job, JobState.running)
        last: Optional[dict] = None
        rule_events: list[tuple[int, dict]] = []  # (step, values) for the alert rules, judged after the batch
        critical = False
        log_bytes = 0
        for e in fresh:
            d = e.data
            if e.kind == "metrics":
                values, refused = NAMES.admit(s, job_id, d["values"])
                if refused:
                    too_many_names(s, job, out)
                if points.add(s, job_id, job.attempt, d["step"], e.t, values):  # a NaN/inf among them:
                    e.data = {**d, "values": {k: metric_wire(v) for k, v in d["values"].items()}}  # live: words
                out.stored_points += len(values)
                if by_metric:
                    rule_events.append((d["step"], values))
                if is_system(values):
                    continue  # the agent's system samples, keyed by time: not the job's step or its latest metrics
                if last is None:
                    last = json.loads(job.last) if job.last else {}
                last.update(values)
                last["step"] = job.step = d["step"]
            else:
                event_rows.append((job_id, e.seq, e.t, e.kind, json.dumps(d)))
                if e.kind == "log":
                    log_bytes += len(event_rows[-1][4])
                apply_event(s, job, e, out)
                critical = critical or e.kind in ("state", "alert")
        if rule_events:  # judged after the commit, beside ingest (server/rule_runner.py)
            out.rule_work.append((JobRef(job.id, job.name, job.owner_token_id, job.agent_id), rule_events))
        if state_rules and job.state != state_before:
            RULES.on_state(s, job, job.state, out)
        if log_bytes:
            LOG_BUDGET.add(s, job_id, log_bytes)  # the job's log bounded by log_max_bytes (logcap.py)
        if last is not None:
            # a NaN/inf latest value is kept as its word ("nan", "inf", "-inf"): the lists show it
            job.last = json.dumps({k: v if type(v) is str else metric_wire(v) for k, v in last.items()
                                   if isinstance(v, (int, float)) or v in NONFINITE_WORDS})
        out.live[job_id] = [[{"kind": e.kind, "seq": e.seq, "t": e.t, "data": e.data} for e in fresh],
                            critical, job]
    points.store(s)
    deferred = s.info.get("event_rows")
    if deferred is not None:
        deferred.extend(event_rows)  # the agent channel stores a whole gathering's rows at once
    elif event_rows:
        store_event_rows(s, event_rows)
    return out


def too_many_names(s: Session, job: Job, out: Outcome) -> None:
    """The job passed metric_names_per_job (ingest/metric_names.py): one warning alert says so."""
    d = NAMES.first_refusal(job.id)
    if d is not None:
        alert = upsert_alert(s, job.id, job.agent_id, d)
        if alert is not None:
            payload = alert_dict(alert)
            out.alerts.append(payload)
            out.frames.append((ALERTS_TOPIC, alert_frame(payload), False))


def is_system(values: dict) -> bool:
    """A metrics event of the agent's system samples (worker/agent/sysmetrics.py: every name sys/...)."""
    return bool(values) and next(iter(values)).startswith("sys/")


def store_event_rows(s: Session, rows: list[tuple]) -> None:
    raw_cursor(s).executemany(PG_INSERT_EVENT if dialect_name(s) == "postgresql" else INSERT_EVENT, rows)


def _rank_exits(d) -> Optional[dict[int, str]]:
    if not isinstance(d, dict):
        return None
    return {int(k): str(v)[:200] for k, v in d.items() if str(k).isdigit() and int(k) < 1024}


def slurm_pending(e) -> bool:
    """A Slurm executor's word while Slurm holds the job pending: the job is not running yet."""
    return (e.kind == "phase" and e.data.get("name") == Phase.SLURM_PENDING) or (
        e.kind == "info" and set(e.data) == {"slurm"})


def apply_event(s: Session, job: Job, e: Ev, out: Outcome) -> None:
    """What a non-metric event changes on its job (the event row itself is stored by the caller)."""
    d = e.data
    if e.kind == "phase":
        job.phase = json.dumps(d)
        total, done = d.get("total"), d.get("done")
        if d.get("name") == Phase.TRAINING and total and math.isfinite(total) and 0 < total < INT_LIMIT:
            job.total_steps = int(total)
            if done is not None and math.isfinite(done) and 0 <= done < INT_LIMIT:
                job.step = int(done)
    elif e.kind == "state":
        state = JobState(d["state"])
        store.end_attempt(s, job, state, d.get("reason"), d.get("failure"), d.get("exit_code"),
                          d.get("signal"), d.get("retry", False), _rank_exits(d.get("ranks")),
                          step=d.get("step"), frame=d.get("frame"), peak_mb=d.get("peak_mb"))
    elif e.kind == "checkpoint":
        if d.get("final"):
            job.output_dir = d["path"]
        else:
            job.checkpoint = d["path"]
            # a checkpoint at step N means N steps are done: a pause saves one a step past the last
            # logged metric, and the job must not say "paused at 368" beside its reason's "369"
            if isinstance(d.get("step"), int) and d["step"] > (job.step or 0):
                job.step = d["step"]
            if d.get("request_s") is not None and job.attempt:  # a checkpoint asked for: how long it took
                s.execute(update(Attempt).where(Attempt.job_id == job.id, Attempt.attempt == job.attempt)
                          .values(checkpoint_s=float(d["request_s"])))
    elif e.kind == "info":
        info = json.loads(job.info) if job.info else {}
        info.update(d)
        job.info = json.dumps(info)
    elif e.kind == "alert":
        if RULES.rules and d["kind"] == "stalled":
            RULES.on_state(s, job, "not stalled" if d.get("clear") else "stalled", out)
        elif RULES.rules and d["kind"].startswith(NON_FINITE_ALERT):
            RULES.on_non_finite_alert(s, job, d["kind"][len(NON_FINITE_ALERT):], bool(d.get("clear")), out)
        if job.kind == EXTERNAL and "data" in d:  # a script's own word: no fix or cost (an agent's only)
            d = {k: v for k, v in d.items() if k != "data"}
        if d.get("clear"):
            d = fixes.clear_reason(s, job, d)  # "fix #1 applied", not "the training process ended (paused)"
        alert = upsert_alert(s, job.id, job.agent_id, d)
        if alert is not None:
            payload = alert_dict(alert)
            out.alerts.append(payload)
            out.frames.append((ALERTS_TOPIC, alert_frame(payload), False))
