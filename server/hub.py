"""Fan-out of live frames to websocket subscribers, with bounded per-client buffers.

Each frame is serialized once (orjson, on the writer thread for ingest frames) and the same text is
shared by every subscriber. A client that cannot keep up never slows ingest or the others: each has
its own queue and sender task. When a queue reaches its bound, it is compacted: droppable frames
(metrics/log events, heartbeats, job summaries) are coalesced per job - the newest summary or
heartbeat supersedes older ones, queued events frames of one job are merged into one (the newest
MAX_MERGED_EVENTS events or MAX_MERGED_BYTES; older ones are counted as dropped and the frame says
"missed": n, so a page can refill from REST). Alerts and state changes are never dropped or merged. A client whose queue
still reaches 4x the bound (undroppable frames only) is disconnected; the page reloads from REST.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Iterable, Optional, Union

import orjson

from tokenpulse.protocol import (
    AGENT_FRAME,
    EVENTS_FRAME,
    HEARTBEAT_FRAME,
    JOB_FRAME,
    JOBS_TOPIC,
    events_frame,
    job_frame,
    job_topic,
)

MAX_MERGED_EVENTS = 5000
MAX_MERGED_BYTES = 1 << 20  # a merged frame stays under ~1 MB of JSON


def dumps(payload: dict) -> str:
    # orjson: ~5x faster than json.dumps for event lists, and safe to call off the event loop.
    return orjson.dumps(payload).decode()


def coalesce_key(payload: dict) -> Optional[tuple]:
    kind = payload.get("type")
    if kind == EVENTS_FRAME or kind == HEARTBEAT_FRAME:
        return (kind, payload["job_id"])
    if kind == JOB_FRAME:
        return (kind, payload["job"].get("id"))
    if kind == AGENT_FRAME:
        return (kind, payload["agent"].get("id"))
    return None


def job_frames(summary: dict, droppable: bool = False) -> list[tuple[str, dict, bool]]:
    """A job's summary for the jobs list and for the job's own page: (topic, frame, droppable)."""
    frame = job_frame(summary)
    return [(JOBS_TOPIC, frame, droppable), (job_topic(summary["id"]), frame, droppable)]


class Frame:
    __slots__ = ("text", "droppable", "key", "payload")

    def __init__(self, payload: dict, droppable: bool):
        self.text = dumps(payload)
        self.droppable = droppable
        self.key = coalesce_key(payload)
        self.payload = payload  # kept for merging events frames of a lagging client

    @classmethod
    def from_text(cls, text: str, droppable: bool) -> "Frame":
        """A frame another server process serialized (server/relay.py): its text kept as sent,
        parsed once for coalescing and merging."""
        f = cls.__new__(cls)
        f.text, f.droppable = text, droppable
        f.payload = orjson.loads(text)
        f.key = coalesce_key(f.payload)
        return f


def merge(frames: list[Frame]) -> tuple[Frame, int]:
    """Several queued frames with one key -> one frame; returns it and how many events were lost
    (the oldest beyond MAX_MERGED_EVENTS or MAX_MERGED_BYTES, counted in the frame's "missed")."""
    last = frames[-1]
    if len(frames) == 1 or last.key[0] != EVENTS_FRAME:
        return last, 0  # summaries and heartbeats: the newest says it all
    kept: list[list] = []
    n = size = lost = 0
    for f in reversed(frames):  # newest first, until the caps
        evs = f.payload["events"]
        lost += f.payload.get("missed", 0)
        room = min(MAX_MERGED_EVENTS - n, len(evs) * max(0, MAX_MERGED_BYTES - size) // max(1, len(f.text)))
        take = evs[len(evs) - room:] if room < len(evs) else evs
        kept.append(take)
        n, size = n + len(take), size + len(f.text) * len(take) // max(1, len(evs))
        lost += len(evs) - len(take)
    payload = events_frame(last.payload["job_id"], [e for evs in reversed(kept) for e in evs], lost)
    new_lost = lost - sum(f.payload.get("missed", 0) for f in frames)
    return Frame(payload, True), new_lost


class Subscriber:
    def __init__(self, topics: Iterable[str], max_frames: int):
        self.topics = set(topics)
        self.max_frames = max_frames
        self.frames: deque[Frame] = deque()
        self.ready = asyncio.Event()
        self.dropped = 0  # events or frames this client never got (it lagged)
        self.coalesced = 0  # compactions of its queue
        self.overflowed = False

    def push(self, frame: Frame) -> None:
        if self.overflowed:
            return
        if len(self.frames) >= self.max_frames:
            self.compact()
            if len(self.frames) >= 4 * self.max_frames:
                self.overflowed = True  # the sender closes this socket; the page reloads from REST
                self.frames.clear()
                self.ready.set()
                return
        self.frames.append(frame)
        self.ready.set()

    def compact(self) -> None:
        """Coalesce droppable frames per key (placed where the newest of them was); keep the order
        of everything else. An undroppable frame of the same key (events with a state change or an
        alert) is a barrier: nothing merges across it, so a job's events stay in order. O(queue),
        and only when the queue is full: amortized O(1) a push."""
        self.coalesced += 1
        groups: dict[tuple, list[Frame]] = {}
        barrier: dict[tuple, int] = {}
        slots: list = []  # frames kept as they are, or the group key whose merge goes there
        for f in self.frames:
            if not f.droppable:
                if f.key is not None:
                    barrier[f.key] = barrier.get(f.key, 0) + 1
                slots.append(f)
            elif f.key is None:
                self.dropped += 1
            else:
                g = (f.key, barrier.get(f.key, 0))
                groups.setdefault(g, []).append(f)
                slots.append(g)
        out: deque[Frame] = deque()
        seen = {g: len(fs) for g, fs in groups.items()}
        for slot in slots:
            if isinstance(slot, Frame):
                out.append(slot)
                continue
            seen[slot] -= 1
            if seen[slot] == 0:  # the newest of its group: the merged frame goes here
                merged, lost = merge(groups[slot])
                self.dropped += lost
                out.append(merged)
        self.frames = out

    async def next_batch(self) -> list[Frame]:
        while not self.frames and not self.overflowed:
            self.ready.clear()
            await self.ready.wait()
        out = list(self.frames)
        self.frames.clear()
        return out


class Hub:
    def __init__(self, max_frames: int = 256):
        self.max_frames = max_frames
        self.by_topic: dict[str, set[Subscriber]] = {}
        # Several server processes on one PostgreSQL: frames for topics other processes' browsers
        # watch go to them too (server/relay.py); None with SQLite (one process).
        self.relay = None

    def subscribe(self, topics: Iterable[str]) -> Subscriber:
        sub = Subscriber(topics, self.max_frames)
        for t in sub.topics:
            self.by_topic.setdefault(t, set()).add(sub)
        if self.relay is not None:
            self.relay.topics_changed()
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        for t in sub.topics:
            subs = self.by_topic.get(t)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self.by_topic[t]
        if self.relay is not None:
            self.relay.topics_changed()

    def client_count(self) -> int:
        return len({sub for subs in self.by_topic.values() for sub in subs})

    def watched(self, topic: str) -> bool:
        """Anyone listening? (Read from the writer thread too: a dict lookup, safe under the GIL.
        A client subscribing at that very moment refills from REST anyway.)"""
        return topic in self.by_topic or (self.relay is not None and self.relay.wanted(topic))

    def publish(self, topic: str, payload: Union[dict, Frame], droppable: bool = True) -> None:
        """Call on the event loop thread only. payload may be a Frame built (serialized) elsewhere."""
        subs = self.by_topic.get(topic)
        remote = self.relay is not None and self.relay.wanted(topic)
        if not subs and not remote:
            return
        frame = payload if isinstance(payload, Frame) else Frame(payload, droppable)
        for sub in subs or ():
            sub.push(frame)
        if remote:
            self.relay.send(topic, frame)

    def deliver(self, topic: str, text: str, droppable: bool) -> None:
        """A frame another server process published (server/relay.py): to this process's browsers."""
        subs = self.by_topic.get(topic)
        if not subs:
            return
        frame = Frame.from_text(text, droppable)
        for sub in subs:
            sub.push(frame)

    def publish_all(self, frames: Iterable[tuple]) -> None:
        """(topic, payload or Frame, droppable) triples, as the writer-thread code returns them."""
        for topic, payload, droppable in frames:
            self.publish(topic, payload, droppable)
