"""Alert webhooks: POST each alert as JSON (with a Slack-compatible "text") to configured URLs,
with a timeout and retries, from a background task: ingest never waits on a receiver."""
from __future__ import annotations

import asyncio
import logging

import httpx

log = logging.getLogger("tokenpulse.webhooks")


class Webhooks:
    def __init__(self, urls: list[str], timeout_s: float, retries: int):
        self.urls = urls
        self.timeout_s = timeout_s
        self.retries = retries
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=10_000)
        self.task = None

    def start(self) -> None:
        if self.urls:
            self.task = asyncio.create_task(self._run())

    def send(self, alert: dict) -> None:
        if not self.urls:
            return
        try:
            self.queue.put_nowait(alert)
        except asyncio.QueueFull:
            log.error("webhook queue full; alert %s not delivered", alert.get("id"))

    @staticmethod
    def body(alert: dict) -> dict:
        where = f"job {alert['job_id']}" if alert.get("job_id") else "tokenpulse"
        state = "cleared" if alert.get("state") == "cleared" else alert.get("severity", "warning")
        return {**alert, "text": f"[tokenpulse] {where}: {alert['kind']} ({state}): {alert['message']}"}

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            while True:
                alert = await self.queue.get()
                for url in self.urls:
                    await self._deliver(client, url, self.body(alert))

    async def _deliver(self, client: httpx.AsyncClient, url: str, body: dict) -> None:
        for attempt in range(self.retries + 1):
            try:
                r = await client.post(url, json=body)
                if r.status_code < 500:
                    return
                log.warning("webhook %s answered %s (try %d)", url, r.status_code, attempt + 1)
            except httpx.HTTPError as e:
                log.warning("webhook %s failed: %s (try %d)", url, e, attempt + 1)
            await asyncio.sleep(min(0.5 * 2 ** attempt, 10))
        log.error("webhook %s: giving up on alert %s", url, body.get("id"))

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
