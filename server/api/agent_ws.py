"""An agent's one persistent connection: `/api/agents/{id}/ws` (agent token, as a bearer header).

The same protocol as the HTTP routes, as JSON text messages; each request carries an "id" that its
answer repeats:
  agent -> server  {"id": 7, "heartbeat": {"<job id>": alive_at, ...}}
                   {"id": 8, "events": [...]}                      (an EventBatch's events)
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

    async def push_loop():
        while True:
            await sub.next_batch()
            await ws.send_text('{"nudge":true}')

    pusher = asyncio.create_task(push_loop())
    pending: set[asyncio.Task] = set()
    try:
        while True:
            text = await ws.receive_text()
            if tp.caller(header.partition(" ")[2].strip()) is None:  # revoked: at once, as on HTTP
                await ws.close(code=4401, reason="token revoked")
                return
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
            if "heartbeat" in msg and isinstance(msg["heartbeat"], dict) and len(msg["heartbeat"]) <= 1000:
                try:
                    jobs = {int(k): float(v) for k, v in msg["heartbeat"].items()}
                except (TypeError, ValueError):
                    jobs = None
                if jobs is None:
                    await ws.send_text(orjson.dumps({"id": mid, "status": 422, "detail": "heartbeat: job id -> time"}).decode())
                    continue
                fut = tp.agent_writes.submit("heartbeat", agent_id, jobs)
            elif isinstance(msg.get("events"), list):
                # the text as it came: parse_batch reads its "events" (checked on the writer thread)
                fut = tp.agent_writes.submit("events", agent_id, text.encode())
            else:
                await ws.send_text(orjson.dumps({"id": mid, "status": 422, "detail": "heartbeat or events"}).decode())
                continue

            async def answer(fut=fut, mid=mid):
                reply = await fut
                reply["id"] = mid
                await ws.send_text(orjson.dumps(reply).decode())
            task = asyncio.create_task(answer())
            pending.add(task)
            task.add_done_callback(pending.discard)
    except WebSocketDisconnect:
        pass
    finally:
        pusher.cancel()
        for t in pending:
            t.cancel()
        tp.hub.unsubscribe(sub)

