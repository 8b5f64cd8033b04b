"""The agent's one persistent connection to the server (`/api/agents/{id}/ws`, server/api/agent_ws.py):
heartbeats (rank rows included) and event batches as protocol.AgentMessage, each answered with the
reply the HTTP route would give; nudges pushed when a person asks for something on one of its jobs;
and "work" pushed when a job is queued, so an idle agent claims then instead of polling
(wait_for_work: 100 idle agents polling a claim a second cost the server ~30% of a core).

Costs the server a fraction of HTTP requests (it batches every agent's writes into one
transaction). While the socket is down, or against a server without it, request() returns None
and the agent uses HTTP: the HTTP protocol stays complete on its own.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import TYPE_CHECKING, Callable, Optional

from tokenpulse.protocol import NUDGE_FRAME, WORK_FRAME, Heartbeat

if TYPE_CHECKING:  # imported when run() connects: an HTTP-only agent never loads websockets
    from websockets.asyncio.client import ClientConnection

log = logging.getLogger("tokenpulse.agent")
RETRY_S = 2.0  # after a dropped connection
REFUSED_RETRY_S = 60.0  # a server that refuses the websocket (an older one): HTTP meanwhile
# An idle agent on the socket claims when the server says a job waits: a push (followed at once), or
# "work" in a heartbeat's answer while any job waits, followed at most every WORK_HINT_EVERY_S (a job
# this agent cannot take must not make it claim at every beat); and anyway every IDLE_CLAIM_S.
WORK_HINT_EVERY_S = 10.0
IDLE_CLAIM_S = 30.0


class Channel:
    def __init__(self, server: str, token: str, agent_id: Callable[[], Optional[int]], on_nudge: Callable[[], None]):
        self.base = server.replace("https://", "wss://").replace("http://", "ws://")
        self.token, self.agent_id, self.on_nudge = token, agent_id, on_nudge
        self.ws: Optional[ClientConnection] = None
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future] = {}
        self.work_at = 0.0  # monotonic time the server last said a job waits (see wait_for_work)
        self.idle_since = 0.0  # monotonic time of the claim wait_for_work follows
        self.work = asyncio.Event()

    async def run(self) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidStatus
        while True:
            wait = RETRY_S
            aid = self.agent_id()
            try:
                async with connect(f"{self.base}/api/agents/{aid}/ws", max_size=None, open_timeout=30,
                                   additional_headers={"Authorization": f"Bearer {self.token}"}) as ws:
                    self.ws = ws
                    log.info("agent websocket connected")
                    async for text in ws:
                        msg = json.loads(text)
                        if "id" in msg:  # an answer (a heartbeat's may say "work": see request)
                            fut = self.waiting.pop(msg["id"], None)
                            if fut is not None and not fut.done():
                                fut.set_result(msg)
                        elif msg.get(NUDGE_FRAME):
                            self.on_nudge()
                        elif msg.get(WORK_FRAME):
                            self._work_waits()
            except asyncio.CancelledError:
                raise
            except InvalidStatus as e:
                wait = REFUSED_RETRY_S
                log.info("agent websocket refused (%s): using HTTP", e.response.status_code)
            except Exception as e:  # noqa: BLE001 - any failure: HTTP until it reconnects
                log.info("agent websocket closed (%s); using HTTP meanwhile", e)
            finally:
                self.ws = None
                for fut in self.waiting.values():
                    if not fut.done():
                        fut.set_result(None)
                self.waiting.clear()
            await asyncio.sleep(wait)

    async def request(self, msg: dict, timeout: float = 10.0) -> Optional[dict]:
        """The server's answer, or None (not connected, or lost on the way): then use HTTP."""
        ws = self.ws
        if ws is None:
            return None
        mid = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[mid] = fut
        try:
            await ws.send(json.dumps({"id": mid, **msg}))
            reply = await asyncio.wait_for(fut, timeout)
            if reply is not None and reply.get("work") and time.monotonic() - self.idle_since >= WORK_HINT_EVERY_S:
                self._work_waits()
            return reply
        except asyncio.TimeoutError:
            # an answer that never comes (a socket half-dead across a server restart): drop the
            # socket, so this and every later message go over HTTP until run() reconnects
            self.waiting.pop(mid, None)
            log.info("agent websocket: no answer in %.0f s; closing it, using HTTP meanwhile", timeout)
            asyncio.get_running_loop().create_task(ws.close())
            return None
        except Exception:  # noqa: BLE001 - closed: the caller falls back to HTTP
            self.waiting.pop(mid, None)
            return None

    async def heartbeat(self, beat: Heartbeat, timeout: float = 10.0) -> Optional[dict]:
        """A Heartbeat, rank rows included, as one message; its AgentReply, or None (then use HTTP)."""
        return await self.request({"heartbeat": beat.model_dump(mode="json", exclude_none=True)}, timeout)

    def _work_waits(self) -> None:
        self.work_at = time.monotonic()
        self.work.set()

    async def wait_for_work(self, claimed_at: float, poll_s: float, stopped: asyncio.Event) -> None:
        """After a claim (sent at monotonic claimed_at) that found nothing: on the socket, until the
        server says a job waits (said after claimed_at), IDLE_CLAIM_S at most; without the socket,
        poll_s as before (an HTTP-only agent polls). Returns early when stopped is set."""
        self.idle_since = claimed_at
        end = claimed_at + (IDLE_CLAIM_S if self.ws is not None else poll_s)
        while self.work_at <= claimed_at and not stopped.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return
            if self.ws is None:  # dropped meanwhile: poll again
                end = min(end, claimed_at + poll_s)
            self.work.clear()
            waits = [asyncio.ensure_future(self.work.wait()), asyncio.ensure_future(stopped.wait())]
            try:
                await asyncio.wait(waits, timeout=min(left, poll_s if self.ws is None else left),
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
