"""Agent websockets' writes, many agents per writer transaction.

An HTTP heartbeat or event batch costs ~2 ms of server CPU, most of it not the database: the HTTP
request, routing, a writer-thread hand-off, a session and a commit of its own. Over an agent's
websocket (server/api/agent_ws.py) a message costs a frame and a JSON parse; the writes of every
agent queue here for up to GATHER_S (250 ms; a state change or alert at once) and go to the writer
as ONE transaction: the jobs they touch loaded in one query, one commit, one hand-off. 100 agents
beating every 2 s with a phase event a second then cost a few percent of a core.

The messages are applied by the HTTP routes' own handler (server/agent_protocol.py), so each gets
the answer its HTTP twin would give (acks, commands, or the 4xx); a failure of the whole
transaction (a locked or full database) answers every message in it with a 503 and the agents
resend, as after a lost HTTP reply.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Optional

from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import DataError, OperationalError

from server.agent_protocol import Incoming, after_ingest, apply_messages
from server.ingest import apply, parse
from tokenpulse.protocol import AgentAnswer, AgentMessage, refusal, socket_answer

log = logging.getLogger("tokenpulse.agent_channel")
# A message waits at most this long for others to share its transaction (a state change or an alert
# does not wait). Measured on 2 loaded cores, 100 agents: 0.1 s ~7% of a core, 0.25 s ~4.5%.
GATHER_S = 0.25
URGENT = ("state", "alert")  # event kinds that do not wait for a gathering


class AgentWrites:
    def __init__(self, tp):
        self.tp = tp
        self.pending: list[tuple[int, AgentMessage, asyncio.Future]] = []
        self.flushing = False
        self.urgent = asyncio.Event()

    def submit(self, agent_id: int, message: AgentMessage) -> asyncio.Future:
        """A checked message (a heartbeat, an event batch, or both); the future resolves to its AgentAnswer."""
        fut = asyncio.get_running_loop().create_future()
        self.tp.arriving.add(agent_id)  # until it is applied: the reaper spares its agent
        fut.add_done_callback(lambda _: self.tp.arriving.done(agent_id))
        self.pending.append((agent_id, message, fut))
        if message.events and any(isinstance(e, dict) and e.get("kind") in URGENT for e in message.events):
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
                    fut.set_result(refusal(503, "the server could not store this now; send it again"))
        except Exception:  # noqa: BLE001 - one message the database refused (PostgreSQL: a NUL in
            # text) must not fail the others: each goes again in a transaction of its own
            for item in items:
                try:
                    self._done([item], *await tp.db.write(lambda s, item=item: self._apply(s, [item])))
                except Exception as e:  # noqa: BLE001
                    if not item[2].done():
                        item[2].set_result(refusal(422 if isinstance(e, DataError) else 503,
                                                   str(e).splitlines()[0][:300]))

    def _done(self, items, answers: list[AgentAnswer], outcome: apply.Outcome) -> None:
        for (*_, fut), answer in zip(items, answers):
            if not fut.done():
                fut.set_result(answer)
        after_ingest(self.tp, outcome)

    def _apply(self, s, items) -> tuple[list[AgentAnswer], apply.Outcome]:
        """Each message's events checked (a 422 answered as parsed: nothing of it is written), then
        the others applied together, in arrival order."""
        answers: list[Optional[AgentAnswer]] = []
        incoming: list[Incoming] = []
        for agent_id, msg, _ in items:
            try:
                events = parse.parse_events(msg.events) if msg.events is not None else None
            except RequestValidationError as e:
                first = e.errors()[0] if e.errors() else {}
                answers.append(refusal(422, str(first.get("msg", "invalid"))))
                continue
            answers.append(None)
            incoming.append(Incoming(agent_id, heartbeat=msg.heartbeat, events=events))
        applied = apply_messages(s, self.tp, incoming)
        replies = iter(zip(incoming, applied.replies))
        for i, answer in enumerate(answers):
            if answer is None:
                m, reply = next(replies)
                answers[i] = socket_answer(reply, with_acks=m.events is not None)
        return answers, applied.outcome
