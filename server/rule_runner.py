"""Metric rules judged beside ingest, never inside the single writer (issue 34).

Ingest notes each batch's (step, values) for the jobs that have metric rules (apply.Outcome.rule_work);
once the batch is committed (agent_protocol.after_ingest) they queue here. One thread of its own
judges them against the rules in memory (server/rules.py; it reads the database only to rebuild a
rule's memory after a start), then the alerts that opened or cleared are written in one small write
and sent to the hub and the webhooks. Ingest's cost with any number of rules is a dict lookup per
job and batch; a user's thousand rules delay only their own alerts.

The queue is bounded (MAX_PENDING batches): past it a batch's rules are not judged, logged and
counted, and ingest never waits.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from server.rules import RULES, Fired, store_changes

log = logging.getLogger("tokenpulse.rules")
MAX_PENDING = 10_000  # batches waiting to be judged
MAX_AT_ONCE = 500  # batches judged in one pass (one read session, one write)


class RuleRunner:
    def __init__(self, tp):
        self.tp = tp
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=MAX_PENDING)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="rules")
        self.task = None
        self.dropped = 0
        self.judged = 0

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    def submit(self, work: list) -> None:
        """(JobRef, [(step, values)]) of committed batches; never blocks."""
        for item in work:
            try:
                self.queue.put_nowait(item)
            except asyncio.QueueFull:
                self.dropped += 1
                if self.dropped % 1000 == 1:
                    log.error("alert rules: %d batches waiting; %d not judged so far", MAX_PENDING, self.dropped)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            while not self.queue.empty() and len(items) < MAX_AT_ONCE:
                items.append(self.queue.get_nowait())
            try:
                fired = await loop.run_in_executor(self.thread, self._judge, items)
                self.judged += len(items)
                if fired.changes:
                    await self.tp.db.write(lambda s: store_changes(s, fired.changes, fired))
                    self.tp.hub.publish_all(fired.frames)
                    if self.tp.webhooks is not None:
                        self.tp.webhooks.send_all(fired.alerts)
            except Exception:  # noqa: BLE001 - the runner outlives any one bad pass
                log.exception("alert rules: a pass failed")

    def _judge(self, items: list) -> Fired:
        fired = Fired(deferred=True)
        with self.tp.db.read() as s:
            RULES.refresh(s)
            for job, events in items:
                by_metric, _ = RULES.for_job(job)
                if by_metric:
                    RULES.on_metrics(s, job, events, by_metric, fired)
        RULES.bound_memory()
        return fired

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.thread.shutdown(wait=False, cancel_futures=True)
