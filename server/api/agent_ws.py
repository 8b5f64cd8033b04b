"""An agent's one persistent connection: `/api/agents/{id}/ws` (agent token, as a bearer header).

The same protocol as the HTTP routes, as JSON text messages; each request carries an "id" that its
answer repeats:
  agent -> server  {"id": 7, "heartbeat": {"<job id>": alive_at, ...}}
                   {"id": 8, "events": [...]}                      (an EventBatch's events)
                   {"id": 9, "events": [...], "heartbeat": {...}}  (both: a heartbeat folded into a batch)
  server -> agent  {"id": 7, "commands": [...]}                    (an AgentReply)
                   {"id": 8, "acked": {"<job id>": seq}, "commands": [...]}
                   {"id": 9, "status": 422, "detail": "..."}      (what the HTTP route would answer)
                   {"nudge": true}    pushed when a person asks for something on one of its jobs
                                      (cancel, pause, stack): the agent heartbeats at once and gets
                                      the command in the answer, instead of within a heartbeat period.
Writes of all connected agents share writer transactions (server/agent_channel.py). Registering and
claiming stay HTTP; so does everything for an agent that cannot hold a websocket.
"""
from __future__ import annotations

import asyncio
import json
import time

import orjson
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from server.security import websocket_caller
from server.models import Agent

router = APIRouter()
MAX_MESSAGE = 1 << 20  # bigger batches go over HTTP (the bulk lane)


def agent_topic(agent_id: int) -> str:
    """The hub topic an agent's connection listens on (across server processes too: server/relay.py)."""
    return f"agent:{agent_id}"


@router.websocket("/api/agents/{agent_id}/ws")
async def agent_socket(ws: WebSocket, agent_id: int):
    tp = ws.app.state.tp
    caller = websocket_caller(ws)
    if caller is None or caller.role != "agent":
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
    sub = tp.hub.subscribe([agent_topic(agent_id)])
    header = ws.headers.get("authorization", "")

    replies: asyncio.Queue = asyncio.Queue()  # answers in the order they are ready, one sender

    async def push_loop():
        while True:
            await sub.next_batch()
            replies.put_nowait('{"nudge":true}')

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
                await ws.send_text(orjson.dumps({"id": mid, "status": 413, "detail": "too large; use HTTP"}).decode())
                continue
            jobs = body = None
            if "heartbeat" in msg:  # may come alone or folded into an event batch: one message a beat
                try:
                    assert isinstance(msg["heartbeat"], dict) and len(msg["heartbeat"]) <= 1000
                    jobs = {int(k): float(v) for k, v in msg["heartbeat"].items()}
                except (AssertionError, TypeError, ValueError):
                    await ws.send_text(orjson.dumps({"id": mid, "status": 422,
                                                     "detail": "heartbeat: job id -> time"}).decode())
                    continue
            if isinstance(msg.get("events"), list):
                body = text.encode()  # as it came: parse_batch reads its "events" on the writer thread
            if jobs is None and body is None:
                await ws.send_text(orjson.dumps({"id": mid, "status": 422, "detail": "heartbeat or events"}).decode())
                continue
            fut = tp.agent_writes.submit(agent_id, jobs, body)
            fut.add_done_callback(answer(mid))
    except WebSocketDisconnect:
        pass
    finally:
        for t in tasks:
            t.cancel()
        tp.hub.unsubscribe(sub)

