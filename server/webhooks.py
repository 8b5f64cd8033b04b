"""Alert webhooks: POST each alert change as JSON (with a Slack-compatible "text") to configured URLs,
with a timeout and retries, from background tasks: ingest never waits on a receiver.

- On open and on clear, never more: an update of an open alert (its numbers, its duration, an
  acknowledgement) is not sent. A clear is held `clear_after_s` (Settings.alert_reopen_s, the window in
  which the server reopens the same alert row): reopened meanwhile, nothing is sent at all, so a
  condition that flickers reaches a receiver as one open and one clear.
- One bounded queue and one task per URL, all posting through ONE shared client (a bounded
  connection pool, built once at start, never per URL): a receiver that is down delays only itself,
  and each receiver sees an alert's changes in order (opened before cleared).
- A rule's own channels (server/rules.py, `channels_for`): the same open/clear life, its own queue per
  URL, and the body its receiver reads: Slack `{"text"}`, Discord `{"content"}`, or the whole alert.
  These URLs are people's, not the admin's: each send resolves the host, refuses internal addresses
  (server/destinations.py; Settings.webhook_allow lifts that) and connects to the address it checked.
  One event (a batch's alert changes) posts at most `sends_per_event` times to one receiver host.
- URLs never reach the log whole: a Slack or Discord webhook URL's path is its secret (`shown`).
- Retries on connection errors, timeouts, 429 and 5xx, with exponential backoff; a 4xx other than
  429 is the receiver refusing the payload: retrying would not help.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import OrderedDict
from urllib.parse import urlsplit

import httpx

from server.destinations import Policy, Refused, parse

log = logging.getLogger("tokenpulse.webhooks")


def shown(url: str) -> str:
    """A receiver as the log names it: scheme and host only. A Slack or Discord webhook URL is a
    credential (its path is the secret), and logs are read by more people than the settings."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or '?'}{':' + str(parts.port) if parts.port else ''}/..."


def described(e: Exception, url: str) -> str:
    """An httpx error without the URL (or its path) that some of them repeat."""
    text = str(e).replace(url, shown(url))
    path = urlsplit(url).path
    if len(path) > 1:
        text = text.replace(path, "/...")
    return f"{type(e).__name__}: {text}"


MAX_CHANNEL_QUEUES = 5000  # distinct rule webhook URLs with a queue at once (rules per user x channels bound them)


class Webhooks:
    def __init__(self, urls: list[str], timeout_s: float, retries: int, backoff_s: float = 0.5,
                 clear_after_s: float = 0.0, policy: Policy = None, connections: int = 20,
                 queue_size: int = 1000, sends_per_event: int = 3):
        self.policy = policy or Policy([])
        self.connections = connections
        self.queue_size = queue_size
        self.sends_per_event = sends_per_event
        self.client: httpx.AsyncClient = None
        self._budget: dict = {}  # (host, port) -> posts queued for the event being sent
        self.clear_after_s = clear_after_s
        self.held: dict = {}  # alert id -> the timer that sends its clear
        self.started_at = time.time()
        self.urls = list(urls)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.queues: dict[str, asyncio.Queue] = {}
        self.tasks: list[asyncio.Task] = []
        self.sent: OrderedDict = OrderedDict()  # alert id -> the last state sent ("open" / "cleared")
        self.delivered = 0
        self.failed = 0
        self.channels_for = lambda alert: []  # a rule alert's own channels (set by create_app)
        self.channel_queues: dict[str, asyncio.Queue] = {}

    def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False, limits=httpx.Limits(
            max_connections=self.connections, max_keepalive_connections=self.connections))
        for url in self.urls:
            self.queues[url] = asyncio.Queue(maxsize=self.queue_size)
            self.tasks.append(asyncio.create_task(self._run(url)))

    def send_all(self, alerts: list[dict]) -> None:
        """One event's alert changes (a batch, a reaper pass): each receiver host of the rules'
        channels gets at most sends_per_event posts of them."""
        budget: dict = {}
        for alert in alerts:
            self.send(alert, budget)

    def send(self, alert: dict, budget: dict = None) -> None:
        """An alert as stored now: queued for every URL when it opened or cleared (never blocks;
        drops with a log line when full)."""
        if not self.urls and not self.channels_for(alert):
            return
        self._budget = {} if budget is None else budget
        key = alert.get("id")
        state = "cleared" if alert.get("state") == "cleared" else "open"  # acked: still open
        if key is None:
            self._queue(alert)
            return
        if state == "open":
            timer = self.held.pop(key, None)
            if timer is not None:  # reopened before its clear went out: its receivers saw it open all along
                timer.cancel()
                return
            if self.sent.get(key) == "open":
                return  # an update of an open alert
            if key not in self.sent and (alert.get("created_at") or time.time()) < self.started_at:
                self.sent[key] = "open"  # opened before this process started: its open went out then
                return
            self._deliver_change(key, alert)
        elif self.sent.get(key) != "cleared" and key not in self.held:
            if self.clear_after_s > 0:
                self.held[key] = asyncio.get_running_loop().call_later(self.clear_after_s, self._release, key, alert)
            else:
                self._deliver_change(key, alert)

    def _release(self, key, alert: dict) -> None:
        if self.held.pop(key, None) is not None:
            self._budget = {}  # a held clear is an event of its own
            self._deliver_change(key, alert)

    def _deliver_change(self, key, alert: dict) -> None:
        self.sent[key] = "cleared" if alert.get("state") == "cleared" else "open"
        self.sent.move_to_end(key)
        while len(self.sent) > 10_000:
            self.sent.popitem(last=False)
        self._queue(alert)

    def _queue(self, alert: dict) -> None:
        key = alert.get("id")
        body = self.body(alert)
        targets = [(url, q, body) for url, q in self.queues.items()]
        seen = set()
        for ch in self.channels_for(alert):
            url = ch["url"]
            if url in seen:
                continue  # the same receiver twice in one rule: one post
            seen.add(url)
            if not self._within_budget(url, key):
                continue
            q = self._channel_queue(url)
            if q is not None:
                targets.append((url, q, channel_body(body, ch.get("format", "slack"))))
        for url, q, body in targets:
            try:
                q.put_nowait(body)
            except asyncio.QueueFull:
                log.error("webhook queue for %s full; alert %s not delivered", shown(url), key)

    def _within_budget(self, url: str, key) -> bool:
        """No amplification: one event posts to one receiver host at most sends_per_event times."""
        try:
            t = parse(url)
        except Refused:
            return True  # refused with its reason when sent
        host = (t.host, t.port)
        used = self._budget.get(host, 0)
        self._budget[host] = used + 1
        if used < self.sends_per_event:
            return True
        if used == self.sends_per_event:
            log.warning("webhook %s: more than %d posts for one event (limit webhook_sends_per_event, "
                        "TOKENPULSE_WEBHOOK_SENDS_PER_EVENT); alert %s and the rest not sent", shown(url),
                        self.sends_per_event, key)
        return False

    def _channel_queue(self, url: str):
        q = self.channel_queues.get(url)
        if q is None:
            if len(self.channel_queues) >= MAX_CHANNEL_QUEUES:
                log.error("webhook %s: %d rule webhooks already have a queue; not delivered", shown(url),
                          MAX_CHANNEL_QUEUES)
                return None
            q = self.channel_queues[url] = asyncio.Queue(maxsize=self.queue_size)
            self.tasks.append(asyncio.create_task(self._run(url, q, checked=True)))
        return q

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

    async def _run(self, url: str, q: asyncio.Queue = None, checked: bool = False) -> None:
        """checked: a person's URL, its destination checked at every send (the admin's are trusted)."""
        q = q or self.queues[url]
        while True:
            body = await q.get()
            try:
                await self._deliver(self.client, url, body, checked)
            except Refused as e:
                self.failed += 1
                log.error("webhook %s refused by this server: %s; alert %s not sent", shown(url), e, body.get("id"))
            except Exception as e:  # one bad delivery must not end the loop
                self.failed += 1
                log.error("webhook %s: delivery failed: %s", shown(url), described(e, url))

    async def _pinned(self, url: str) -> tuple:
        """The URL with its host replaced by the address just resolved and checked, and what the
        receiver must still see (Host header, TLS server name): a rebinding name cannot swap in an
        internal address between the check and the connection."""
        target = self.policy.check_url(url)
        infos = await asyncio.get_running_loop().getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        address = self.policy.checked_addresses(target, [info[4][0] for info in infos])
        u = httpx.URL(url)
        headers = {"Host": u.netloc.decode("ascii")}
        ext = {"sni_hostname": target.host} if target.scheme == "https" else {}
        return u.copy_with(host=address), headers, ext

    async def _deliver(self, client: httpx.AsyncClient, url: str, body: dict, checked: bool = False) -> bool:
        for attempt in range(self.retries + 1):
            try:
                if checked:
                    pinned, headers, ext = await self._pinned(url)
                    r = await client.post(pinned, json=body, headers=headers, extensions=ext)
                else:
                    r = await client.post(url, json=body)
                if r.status_code < 400:
                    self.delivered += 1
                    return True
                if r.status_code != 429 and r.status_code < 500:
                    log.error("webhook %s refused alert %s: %s", shown(url), body.get("id"), r.status_code)
                    self.failed += 1
                    return False
                log.warning("webhook %s answered %s (try %d)", shown(url), r.status_code, attempt + 1)
            except (httpx.HTTPError, OSError) as e:  # OSError: the name did not resolve
                log.warning("webhook %s failed: %s (try %d)", shown(url), described(e, url), attempt + 1)
            if attempt < self.retries:
                await asyncio.sleep(min(self.backoff_s * 2 ** attempt, 30))
        log.error("webhook %s: giving up on alert %s after %d tries", shown(url), body.get("id"), self.retries + 1)
        self.failed += 1
        return False

    async def stop(self) -> None:
        for key in list(self.held):  # clears still held end with the process (as `sent` does)
            self.held.pop(key).cancel()
        for t in self.tasks:
            t.cancel()
        self.tasks = []
        self.channel_queues = {}
        if self.client is not None:
            await self.client.aclose()
            self.client = None


def channel_body(body: dict, fmt: str) -> dict:
    """What a rule's channel receives: Slack reads "text", Discord "content" (at most 2,000 characters)."""
    if fmt == "discord":
        return {"content": body["text"][:2000]}
    if fmt == "slack":
        return {"text": body["text"]}
    return body
