"""Live frames across server processes on one PostgreSQL: LISTEN/NOTIFY.

Each process publishes to its own browsers (server/hub.py) and, through this relay, NOTIFYs the
frame's text on one channel; every other process LISTENs and hands what it hears to its own hub.
A process relays only topics some other process's browsers watch: each one announces its topic set
(on every change, every ANNOUNCE_S, and when a new process says hello), so an idle dashboard costs
nothing and ingest still builds frames only for watched topics (Hub.watched).

NOTIFY payloads are at most 8,000 bytes: a longer frame goes in numbered parts that the listeners
put back together (parts of one message arrive in order: one sender, one connection).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from typing import Optional

log = logging.getLogger("tokenpulse.relay")
CHANNEL = "tokenpulse_frames"
PART_BYTES = 7600  # under NOTIFY's 8,000-byte limit, with room for the header
ANNOUNCE_S = 5.0  # each process says which topics its browsers watch this often (and on change)
FORGET_S = 3 * ANNOUNCE_S  # a process silent this long is gone: its topics are forgotten


def conninfo(url: str) -> str:
    """A psycopg conninfo string from our SQLAlchemy URL."""
    from sqlalchemy.engine import make_url
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def split(text: str) -> list[str]:
    """Pieces of at most PART_BYTES bytes of UTF-8, never cutting a character."""
    if len(text) <= PART_BYTES // 4 or (text.isascii() and len(text) <= PART_BYTES):
        return [text]
    parts, cur, size = [], [], 0
    step = PART_BYTES // 4  # characters at a time: at most 4 bytes each
    for i in range(0, len(text), step):
        piece = text[i:i + step]
        n = len(piece.encode())
        if size + n > PART_BYTES and cur:
            parts.append("".join(cur))
            cur, size = [], 0
        cur.append(piece)
        size += n
    parts.append("".join(cur))
    return parts


class Relay:
    def __init__(self, url: str, hub):
        self.url, self.hub = url, hub
        self.origin = uuid.uuid4().hex[:12]
        self.remote: dict[str, tuple[set, float]] = {}  # origin -> (topics its browsers watch, heard at)
        self.wanted_topics: set[str] = set()  # the union of remote topics
        self.out: deque[str] = deque()
        self.wake = asyncio.Event()
        self.parts: dict[tuple, list] = {}
        self.ids = itertools.count()
        self.tasks: list[asyncio.Task] = []
        self.last_announced: Optional[frozenset] = None
        self.received = 0  # frames heard from other processes (tests, /metrics)

    # -- called by the hub, on the event loop thread --
    def wanted(self, topic: str) -> bool:
        return topic in self.wanted_topics

    def send(self, topic: str, frame) -> None:
        self._queue("f", f"{int(frame.droppable)} {topic}", frame.text)

    def topics_changed(self) -> None:
        self.wake.set()  # the sender announces the new set

    # -- wire format: "<origin> <kind> <msg id> <part> <parts> <header>\n<body>" --
    def _queue(self, kind: str, header: str, body: str) -> None:
        pieces = split(body)
        mid = next(self.ids)
        for i, piece in enumerate(pieces):
            self.out.append(f"{self.origin} {kind} {mid} {i} {len(pieces)} {header}\n{piece}")
        self.wake.set()

    def _announce(self) -> None:
        topics = frozenset(self.hub.by_topic)
        self.last_announced = topics
        self._queue("s", "-", " ".join(sorted(topics)))

    async def start(self) -> None:
        import psycopg
        info = conninfo(self.url)
        self.listen_conn = await psycopg.AsyncConnection.connect(info, autocommit=True)
        self.send_conn = await psycopg.AsyncConnection.connect(info, autocommit=True)
        await self.listen_conn.execute(f"LISTEN {CHANNEL}")
        self._queue("h", "-", "")  # hello: the others announce their topics at once
        self._announce()
        self.tasks = [asyncio.create_task(self._listen()), asyncio.create_task(self._send())]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for conn in (getattr(self, "listen_conn", None), getattr(self, "send_conn", None)):
            if conn is not None:
                await conn.close()

    async def _send(self) -> None:
        next_announce = time.monotonic() + ANNOUNCE_S
        while True:
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=max(0.0, next_announce - time.monotonic()))
            except asyncio.TimeoutError:
                pass
            self.wake.clear()
            if time.monotonic() >= next_announce or frozenset(self.hub.by_topic) != self.last_announced:
                self._announce()
                self._recompute()  # forget processes that stopped announcing
                next_announce = time.monotonic() + ANNOUNCE_S
            batch = []
            while self.out:
                batch.append(self.out.popleft())
            if not batch:
                continue
            try:
                async with self.send_conn.pipeline():  # one round trip for the whole batch
                    for msg in batch:
                        await self.send_conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, msg))
            except Exception:  # noqa: BLE001 - a lost connection must not end live frames for good
                log.exception("relay: NOTIFY failed; reconnecting")
                await self._reconnect_sender()

    async def _reconnect_sender(self) -> None:
        import psycopg
        while True:
            try:
                await self.send_conn.close()
                self.send_conn = await psycopg.AsyncConnection.connect(conninfo(self.url), autocommit=True)
                return
            except Exception:  # noqa: BLE001
                await asyncio.sleep(1.0)

    async def _listen(self) -> None:
        while True:
            try:
                async for n in self.listen_conn.notifies():
                    self._heard(n.payload)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - reconnect and listen again
                log.exception("relay: LISTEN connection lost; reconnecting")
                await asyncio.sleep(1.0)
                try:
                    import psycopg
                    self.listen_conn = await psycopg.AsyncConnection.connect(conninfo(self.url), autocommit=True)
                    await self.listen_conn.execute(f"LISTEN {CHANNEL}")
                    self._queue("h", "-", "")
                except Exception:  # noqa: BLE001
                    pass

    def _heard(self, payload: str) -> None:
        head, _, body = payload.partition("\n")
        origin, kind, mid, part, parts, header = head.split(" ", 5)
        if origin == self.origin:
            return
        if parts != "1":
            key = (origin, mid)
            got = self.parts.setdefault(key, [])
            got.append(body)
            if len(got) < int(parts):
                return
            body = "".join(self.parts.pop(key))
        if kind == "f":
            droppable, topic = header.split(" ", 1)
            self.received += 1
            self.hub.deliver(topic, body, droppable == "1")
        elif kind == "s":
            self.remote[origin] = (set(body.split()) if body else set(), time.monotonic())
            self._recompute()
        elif kind == "h":
            self.wake.set()
            self.last_announced = None  # announce at the next send pass

    def _recompute(self) -> None:
        now = time.monotonic()
        for origin in [o for o, (_, at) in self.remote.items() if now - at > FORGET_S]:
            del self.remote[origin]
        self.wanted_topics = set().union(*(t for t, _ in self.remote.values())) if self.remote else set()
