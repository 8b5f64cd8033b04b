"""Agent websockets' writes, many agents per writer transaction.

An HTTP heartbeat or event batch costs ~2 ms of server CPU, most of it not the database: the HTTP
request, routing, a writer-thread hand-off, a session and a commit of its own. Over an agent's
websocket (server/api/agent_ws.py) a message costs a frame and a JSON parse; the writes of every
agent queue here for up to GATHER_S (250 ms; a state change or alert at once) and go to the writer
as ONE transaction: the jobs they touch loaded in one query, one commit, one hand-off. 100 agents
beating every 2 s with a phase event a second then cost a few percent of a core.

Each message still gets its own answer (acks, commands, or the 4xx its HTTP twin would give); a
failure of the whole transaction (a locked or full database) answers every message in it with a
503 and the agents resend, as after a lost HTTP reply.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from fastapi.exceptions import RequestValidationError
from sqlalchemy import or_, select
from sqlalchemy.exc import DataError, OperationalError

from server import store
from server.ingest import apply, heartbeats, parse
from server.models import Job
from server.reaper import lease_origin
from tokenpulse.protocol import ACTIVE_STATES

log = logging.getLogger("tokenpulse.agent_channel")
# A message waits at most this long for others to share its transaction (a state change or an alert
# does not wait). Measured on 2 loaded cores, 100 agents: 0.1 s ~7% of a core, 0.25 s ~4.5%.
GATHER_S = 0.25


class AgentWrites:
    def __init__(self, tp):
        self.tp = tp
        self.pending: list[tuple[str, int, Any, asyncio.Future]] = []
        self.flushing = False
        self.urgent = asyncio.Event()

    def submit(self, agent_id: int, heartbeat: Optional[dict], body: Optional[bytes]) -> asyncio.Future:
        """A heartbeat ({job id: alive_at}), an event batch (the message's bytes: its "events"), or
        both in one message. The future resolves to the reply dict."""
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((agent_id, heartbeat, body, fut))
        if body is not None and (b'"state"' in body or b'"alert"' in body):
            self.urgent.set()  # a job ended or raised an alert: people wait for that frame, no gathering
        if not self.flushing:
            self.flushing = True
            asyncio.get_running_loop().create_task(self._flush())
        return fut

    async def _flush(self) -> None:
        try:
            await asyncio.wait_for(self.urgent.wait(), GATHER_S)
        except asyncio.TimeoutError:
            pass
        self.urgent.clear()
        items, self.pending, self.flushing = self.pending, [], False
        tp = self.tp
        try:
            self._done(items, *await tp.db.write(lambda s: self._apply(s, items)))
        except OperationalError as e:  # locked, disk full: the database failed them all; each agent resends
            log.warning("agent channel: a write of %d messages failed: %s", len(items), e)
            for *_, fut in items:
                if not fut.done():
                    fut.set_result({"status": 503, "detail": "the server could not store this now; send it again"})
        except Exception:  # noqa: BLE001 - one message the database refused (PostgreSQL: a NUL in
            # text) must not fail the others: each goes again in a transaction of its own
            for item in items:
                try:
                    self._done([item], *await tp.db.write(lambda s, item=item: self._apply(s, [item])))
                except Exception as e:  # noqa: BLE001
                    if not item[3].done():
                        item[3].set_result({"status": 422 if isinstance(e, DataError) else 503,
                                            "detail": str(e).splitlines()[0][:300]})

    def _done(self, items, results, frames, alerts) -> None:
        for (*_, fut), reply in zip(items, results):
            if not fut.done():
                fut.set_result(reply)
        for topic, payload, droppable in frames:
            self.tp.hub.publish(topic, payload, droppable)
        if self.tp.webhooks is not None:
            for alert in alerts:
                self.tp.webhooks.send(alert)

    def _ingest_batches(self, s, items, parsed, results: list, frames: list, alerts: list) -> None:
        """Each message's event batch, one by one, in arrival order (a 422 answered as parsed)."""
        tp = self.tp
        for (agent_id, _, _, _), evs in zip(items, parsed):
            if isinstance(evs, dict):
                results.append(evs)
                continue
            reply: dict = {"commands": []}
            if evs is not None:
                out = apply.ingest(s, agent_id, evs, tp.hub)
                tp.deliveries.note(out.delivered)
                tp.stats.ingested_events += out.stored_events
                tp.stats.ingested_points += out.stored_points
                frames += out.frames
                alerts += out.alerts
                reply = {"acked": {str(k): v for k, v in out.acked.items()},
                         "commands": [c.model_dump() for c in out.commands]}
            results.append(reply)

    def _apply(self, s, items) -> tuple[list[dict], list, list]:
        tp = self.tp
        parsed: list = []  # per message: its events (or None), or the 422 its body earns
        for _, _, body, _ in items:
            try:
                parsed.append(parse.parse_batch(body) if body is not None else None)
            except RequestValidationError as e:  # nothing of it is written
                first = e.errors()[0] if e.errors() else {}
                parsed.append({"status": 422, "detail": str(first.get("msg", "invalid"))})
        # Every job these messages name, and every active job of the agents that beat, in one query:
        # later lookups hit the session's identity map (held here: it keeps only referenced objects).
        job_ids = {e.job_id for evs in parsed if isinstance(evs, list) for e in evs}
        job_ids.update(jid for _, hb, _, _ in items if hb is not None for jid in hb)
        beating = {agent_id for agent_id, hb, _, _ in items if hb is not None}
        active = [x.value for x in ACTIVE_STATES]
        wanted = or_(Job.id.in_(job_ids), Job.agent_id.in_(beating) & Job.state.in_(active))
        query = select(Job).where(wanted).order_by(Job.id)  # one lock order for every process
        if s.get_bind().dialect.name == "postgresql":  # what ingest would lock job by job (apply.py)
            query = query.with_for_update()
        jobs = list(s.scalars(query)) if job_ids or beating else []
        s.info["locked"] = {job.id for job in jobs}
        held: dict[int, list] = {}
        for job in jobs:
            if job.agent_id in beating and job.state in active:
                held.setdefault(job.agent_id, []).append(job)
        results, frames, alerts = [], [], []
        origin = lease_origin(tp.db, tp.started_at)
        # the event rows of every batch go in one statement after the loop (on PostgreSQL a
        # statement per batch was most of a gathering's cost)
        s.info["event_rows"] = event_rows = []
        try:
            self._ingest_batches(s, items, parsed, results, frames, alerts)
        finally:
            del s.info["event_rows"]
        if event_rows:
            apply.store_event_rows(s, event_rows)
        # then every heartbeat at once (a few statements, not a few per agent), against the jobs as
        # the batches above left them
        beats: dict[int, dict] = {}
        for (agent_id, hb, _, _), evs in zip(items, parsed):
            if hb is not None and not isinstance(evs, dict):
                beats.setdefault(agent_id, {}).update(hb)
        if beats:
            s.flush()  # the raw statements below must see what the batches changed
            by_id = {job.id: job for job in jobs}
            commands, fr = heartbeats.heartbeat_many(s, beats, {jid: j.agent_id for jid, j in by_id.items()})
            frames += fr
            for agent_id, hb in beats.items():
                for job in store.reconcile(s, agent_id, set(hb), tp.settings.agent_lost_after_s, origin,
                                           held.pop(agent_id, []), tp.deliveries):
                    summary = store.job_summary(job)
                    frames += [("jobs", {"type": "job", "job": summary}, False),
                               (f"job:{job.id}", {"type": "job", "job": summary}, False)]
            for (agent_id, hb, _, _), reply in zip(items, results):
                if hb is not None and "status" not in reply:
                    have = {(c["job_id"], c["action"]) for c in reply["commands"]}
                    reply["commands"] += [c.model_dump() for c in commands[agent_id]
                                          if (c.job_id, c.action) not in have]
        del jobs
        s.info.pop("locked", None)
        return results, frames, alerts
