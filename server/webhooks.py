"""Alert webhooks: POST each alert change as JSON (with a Slack-compatible "text") to configured URLs,
with a timeout and retries, from background tasks: ingest never waits on a receiver.

- Once per change: an alert is sent when it opens, when its message/severity/state changes, and when
  it clears; a repeat of the same content (an agent re-reporting) is not sent again.
- One queue and one task per URL: a receiver that is down delays only itself, and each receiver
  sees an alert's changes in order (opened before cleared).
- Retries on connection errors, timeouts, 429 and 5xx, with exponential backoff; a 4xx other than
  429 is the receiver refusing the payload: retrying would not help.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import httpx

log = logging.getLogger("tokenpulse.webhooks")


class Webhooks:
    def __init__(self, urls: list[str], timeout_s: float, retries: int, backoff_s: float = 0.5):
        self.urls = list(urls)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.queues: dict[str, asyncio.Queue] = {}
        self.tasks: list[asyncio.Task] = []
        self.sent: OrderedDict = OrderedDict()  # alert id -> signature of the last change sent
        self.delivered = 0
        self.failed = 0

    def start(self) -> None:
        for url in self.urls:
            self.queues[url] = asyncio.Queue(maxsize=10_000)
            self.tasks.append(asyncio.create_task(self._run(url)))

    @staticmethod
    def signature(alert: dict) -> tuple:
        return (alert.get("state"), alert.get("severity"), alert.get("message"), bool(alert.get("stack")))

    def send(self, alert: dict) -> None:
        """Queue an alert change for every URL (never blocks; drops with a log line when full)."""
        if not self.urls:
            return
        key = alert.get("id")
        sig = self.signature(alert)
        if key is not None:
            if self.sent.get(key) == sig:
                return  # nothing changed since the last delivery
            self.sent[key] = sig
            self.sent.move_to_end(key)
            while len(self.sent) > 10_000:
                self.sent.popitem(last=False)
        body = self.body(alert)
        for url, q in self.queues.items():
            try:
                q.put_nowait(body)
            except asyncio.QueueFull:
                log.error("webhook queue for %s full; alert %s not delivered", url, key)

    @staticmethod
    def body(alert: dict) -> dict:
        where = f"job {alert['job_id']}" if alert.get("job_id") else "tokenpulse"
        state = alert.get("state")
        status = "cleared" if state == "cleared" else alert.get("severity", "warning")
        message = alert.get("message") or ""
        text = f"[tokenpulse] {where}: {alert.get('kind')} ({status}): {message}"
        if alert.get("stack") and state != "cleared":
            text += "\nStack attached (see the job page)."
        return {**alert, "text": text[:3900]}

    async def _run(self, url: str) -> None:
        q = self.queues[url]
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            while True:
                body = await q.get()
                try:
                    await self._deliver(client, url, body)
                except Exception:  # one bad delivery must not end the loop
                    log.exception("webhook %s: delivery failed", url)

    async def _deliver(self, client: httpx.AsyncClient, url: str, body: dict) -> bool:
        for attempt in range(self.retries + 1):
            try:
                r = await client.post(url, json=body)
                if r.status_code < 400:
                    self.delivered += 1
                    return True
                if r.status_code != 429 and r.status_code < 500:
                    log.error("webhook %s refused alert %s: %s", url, body.get("id"), r.status_code)
                    self.failed += 1
                    return False
                log.warning("webhook %s answered %s (try %d)", url, r.status_code, attempt + 1)
            except httpx.HTTPError as e:
                log.warning("webhook %s failed: %r (try %d)", url, e, attempt + 1)
            if attempt < self.retries:
                await asyncio.sleep(min(self.backoff_s * 2 ** attempt, 30))
        log.error("webhook %s: giving up on alert %s after %d tries", url, body.get("id"), self.retries + 1)
        self.failed += 1
        return False

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.tasks = []
