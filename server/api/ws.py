"""Websocket: live frames for the topics a client subscribes to.

Topics (tokenpulse/protocol.py names them): "jobs" (job summaries and heartbeats of every job),
"job:<id>" (that job's events), "alerts", "agents". Subscribe with ?topics=jobs,job:3 or by sending
{"subscribe": [...]}.
Frames: tokenpulse/protocol.py's FrameType (job, events, heartbeat, alert, agent; error and subscribed
answer a client's own message), built by its constructors.
"""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from server.security import websocket_caller
from tokenpulse.protocol import error_frame, is_browser_topic, subscribed_frame

router = APIRouter()


class ClientMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown key is a mistake, said so, not ignored
    subscribe: list[str] = Field(default_factory=list, max_length=100)
    unsubscribe: list[str] = Field(default_factory=list, max_length=100)

    @field_validator("subscribe", "unsubscribe")
    @classmethod
    def _topics(cls, v: list[str]) -> list[str]:
        for t in v:
            if not is_browser_topic(t):
                raise ValueError(f"unknown topic {t!r}; use jobs, alerts, agents or job:<id>")
        return v


@router.websocket("/ws")
async def websocket(ws: WebSocket):
    caller = websocket_caller(ws)
    if caller is None or not caller.is_person:
        await ws.close(code=4401, reason="missing or invalid token")
        return
    try:
        first = ClientMessage(subscribe=[t for t in ws.query_params.get("topics", "").split(",") if t])
    except ValidationError as e:
        await ws.close(code=4400, reason=e.errors()[0]["msg"][:120])
        return
    await ws.accept()
    hub = ws.app.state.tp.hub
    sub = hub.subscribe(first.subscribe)

    async def send_loop():
        while True:
            frames = await sub.next_batch()
            if sub.overflowed:
                await ws.close(code=4408, reason="too slow: reload from REST")
                return
            for f in frames:
                await ws.send_text(f.text)

    sender = asyncio.create_task(send_loop())
    try:
        while True:
            msg_in = await ws.receive()
            if msg_in["type"] == "websocket.disconnect":
                break
            raw = msg_in.get("text")
            if raw is None:  # a binary frame: refused like a malformed one, the socket stays open
                await ws.send_text(json.dumps(error_frame("send JSON text frames, "
                                               "e.g. {\"subscribe\": [\"jobs\"]}; binary frames are refused")))
                continue
            if len(raw) > 65536:
                await ws.send_text(json.dumps(error_frame("message too large")))
                continue
            try:
                msg = ClientMessage.model_validate_json(raw)
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(x) for x in err.get("loc", ()))
                text = str(err["msg"]).removeprefix("Value error, ")
                await ws.send_text(json.dumps(error_frame(f"{where}: {text}" if where else text)))
                continue
            hub.unsubscribe(sub)
            sub.topics = (sub.topics | set(msg.subscribe)) - set(msg.unsubscribe)
            for t in sub.topics:
                hub.by_topic.setdefault(t, set()).add(sub)
            await ws.send_text(json.dumps(subscribed_frame(sorted(sub.topics))))
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        sender.cancel()
        hub.unsubscribe(sub)
