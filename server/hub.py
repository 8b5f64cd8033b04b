"""Fan-out of live frames to websocket subscribers, with bounded per-client buffers.

Each frame is serialized once and shared by every subscriber. A client that cannot keep up never
slows ingest or the others: its buffer is bounded, and when full the oldest *droppable* frame
(metrics, heartbeats, job summaries: newer ones supersede them) is dropped; alerts and state
changes are never dropped. A client that still overflows at 4x the bound is disconnected.
"""
from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import Iterable


class Frame:
    __slots__ = ("text", "droppable")

    def __init__(self, payload: dict, droppable: bool):
        self.text = json.dumps(payload, separators=(",", ":"))
        self.droppable = droppable


class Subscriber:
    def __init__(self, topics: Iterable[str], max_frames: int):
        self.topics = set(topics)
        self.max_frames = max_frames
        self.frames: deque[Frame] = deque()
        self.ready = asyncio.Event()
        self.dropped = 0
        self.overflowed = False

    def push(self, frame: Frame) -> None:
        if len(self.frames) >= self.max_frames:
            for i, old in enumerate(self.frames):
                if old.droppable:
                    del self.frames[i]
                    self.dropped += 1
                    break
            else:
                if len(self.frames) >= 4 * self.max_frames:
                    self.overflowed = True  # the sender closes this socket; the page reloads from REST
                    self.ready.set()
                    return
        self.frames.append(frame)
        self.ready.set()

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

    def subscribe(self, topics: Iterable[str]) -> Subscriber:
        sub = Subscriber(topics, self.max_frames)
        for t in sub.topics:
            self.by_topic.setdefault(t, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        for t in sub.topics:
            subs = self.by_topic.get(t)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self.by_topic[t]

    def publish(self, topic: str, payload: dict, droppable: bool = True) -> None:
        """Call on the event loop thread only."""
        subs = self.by_topic.get(topic)
        if not subs:
            return
        frame = Frame(payload, droppable)
        for sub in subs:
            sub.push(frame)
