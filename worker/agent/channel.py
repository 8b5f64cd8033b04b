"""The agent's one persistent connection to the server (`/api/agents/{id}/ws`, server/api/agent_ws.py):
heartbeats and event batches as messages, each answered with the reply the HTTP route would give,
and nudges pushed when a person asks for something on one of its jobs.

Costs the server a fraction of HTTP requests (it batches every agent's writes into one
transaction). While the socket is down, or against a server without it, request() returns None
and the agent uses HTTP: the HTTP protocol stays complete on its own.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
from typing import Callable, Optional

log = logging.getLogger("tokenpulse.agent")
RETRY_S = 2.0  # after a dropped connection
REFUSED_RETRY_S = 60.0  # a server that refuses the websocket (an older one): HTTP meanwhile


class Channel:
    def __init__(self, server: str, token: str, agent_id: Callable[[], Optional[int]], on_nudge: Callable[[], None]):
        self.base = server.replace("https://", "wss://").replace("http://", "ws://")
        self.token, self.agent_id, self.on_nudge = token, agent_id, on_nudge
        self.ws = None
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future] = {}

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
                        if msg.get("nudge"):
                            self.on_nudge()
                        elif "id" in msg:
                            fut = self.waiting.pop(msg["id"], None)
                            if fut is not None and not fut.done():
                                fut.set_result(msg)
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
            return await asyncio.wait_for(fut, timeout)
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
