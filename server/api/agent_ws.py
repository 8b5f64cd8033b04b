"""An agent's one persistent connection: `/api/agents/{id}/ws` (agent token, as a bearer header).

The same protocol as the HTTP routes, as JSON text messages, each a protocol.AgentMessage whose
"id" its answer repeats, applied by the same handler (server/agent_protocol.py):
  agent -> server  {"id": 7, "heartbeat": {"jobs": {"<job id>": alive_at}, "ranks": {...}}}  (a Heartbeat)
                   {"id": 7, "heartbeat": {"<job id>": alive_at, ...}}  (the first dialect: jobs alone)
                   {"id": 8, "events": [...]}                      (an EventBatch's events)
                   {"id": 9, "events": [...], "heartbeat": {...}}  (both: a heartbeat folded into a batch)
  server -> agent  {"id": 7, "commands": [...], "work": true}      (an AgentReply; "work" while a job waits)
                   {"id": 8, "acked": {"<job id>": seq}, "commands": [...]}
                   {"id": 9, "status": 422, "detail": "..."}      (what the HTTP route would answer)
                   {"nudge": true}    pushed when a person asks for something on one of its jobs
                                      (cancel, pause, stack): the agent heartbeats at once and gets
                                      the command in the answer, instead of within a heartbeat period.
                   {"work": true}     pushed to every agent when a job is queued (submitted, cloned,
                                      resumed): an idle agent on its socket claims then, instead of
                                      polling; a heartbeat's answer says "work" too while jobs wait
                                      (what requeues and retries leave), so nothing waits for a push.
Writes of all connected agents share writer transactions (server/agent_channel.py). Registering and
claiming stay HTTP; so does everything for an agent that cannot hold a websocket.
"""
from __future__ import annotations

import asyncio
import json
import time

import orjson
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from server.models import Agent
from server.security import websocket_caller
from tokenpulse.protocol import NUDGE_FRAME, WORK_FRAME, WORK_TOPIC, AgentMessage, agent_topic, refusal, work_frame

router = APIRouter()
MAX_MESSAGE = 1 << 20  # bigger batches go over HTTP (the bulk lane)


def work_queued(tp) -> None:
    """Tell every connected agent that a job waits (they claim over HTTP; one of them gets it)."""
    tp.hub.publish(WORK_TOPIC, work_frame(), droppable=True)


@router.websocket("/api/agents/{agent_id}/ws")
async def agent_socket(ws: WebSocket, agent_id: int):
    tp = ws.app.state.tp
    caller = websocket_caller(ws)
    if caller is None or caller.role != "agent" or caller.job_id is not None:  # a job's credential: HTTP
        await ws.close(code=4401, reason="missing or invalid agent token")
        return

    with tp.db.read() as s:  # once per connection
        agent = s.get(Agent, agent_id)
        found, token_id = agent is not None, agent.token_id if agent is not None else None
    if not found:
        await ws.close(code=4404, reason=f"agent {agent_id} is not registered")
        return
    if token_id is not None and token_id != caller.token_id:
        await ws.close(code=4403, reason="an agent token acts only for the agents it registered")
        return
    await ws.accept()
    sub = tp.hub.subscribe([agent_topic(agent_id), WORK_TOPIC])
    header = ws.headers.get("authorization", "")

    replies: asyncio.Queue = asyncio.Queue()  # answers in the order they are ready, one sender

    async def push_loop():
        while True:
            batch = await sub.next_batch()
            kinds = {(f.payload or {}).get("type") for f in batch}
            if WORK_FRAME in kinds:  # several pushes waiting: each said once
                replies.put_nowait(f'{{"{WORK_FRAME}":true}}')
            if kinds - {WORK_FRAME} or not batch:  # a nudge (anything but work: heartbeat, to be safe)
                replies.put_nowait(f'{{"{NUDGE_FRAME}":true}}')

    async def send_loop():
        while True:
            await ws.send_text(await replies.get())

    def answer(mid):
        def done(fut):
            if not fut.cancelled():
                replies.put_nowait(orjson.dumps({**fut.result(), "id": mid}).decode())
        return done

    tasks = [asyncio.create_task(push_loop()), asyncio.create_task(send_loop())]
    checked_at = time.monotonic()
    try:
        while True:
            text = await ws.receive_text()
            if time.monotonic() - checked_at > 1.0:  # a revoked token stops within a second
                if tp.caller(header.partition(" ")[2].strip()) is None:
                    await ws.close(code=4401, reason="token revoked")
                    return
                checked_at = time.monotonic()
            try:
                try:
                    msg = orjson.loads(text)
                except orjson.JSONDecodeError:  # NaN/Infinity literals (dropped at ingest, as on HTTP)
                    msg = json.loads(text)
                mid = msg["id"]
            except (ValueError, KeyError, TypeError):
                await ws.send_text('{"status":400,"detail":"a JSON object with an id is expected"}')
                continue
            tp.stats.agent_socket_messages += 1
            if len(text) > MAX_MESSAGE:
                await ws.send_text(orjson.dumps({"id": mid, **refusal(413, "too large; use HTTP")}).decode())
                continue
            try:
                message = AgentMessage.model_validate(msg)
            except ValidationError as e:  # the 422 its HTTP twin would answer
                first = e.errors()[0]
                where = ".".join(str(x) for x in first.get("loc", ()))
                await ws.send_text(orjson.dumps({"id": mid, **refusal(422, f"{where}: {first['msg']}".lstrip(": "))}
                                                ).decode())
                continue
            fut = tp.agent_writes.submit(agent_id, message)
            fut.add_done_callback(answer(mid))
    except WebSocketDisconnect:
        pass
    finally:
        for t in tasks:
            t.cancel()
        tp.hub.unsubscribe(sub)

