"""The agent's link to its server: every call retried until the server answers (honouring its
Retry-After), registration, heartbeats, and a job's events sent in batches until acknowledged.

Heartbeats (rank tables included) and event batches go over the agent's websocket (channel.py)
while it is up, over HTTP otherwise: one message model either way. The server's
answers carry acknowledgements (dropped from the outbox here) and commands, handed to `on_commands`
(the job runner's)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Literal, Optional, overload

import httpx

from tokenpulse.protocol import AgentHello, AgentReply, Command, Heartbeat, Registered, event_batch_body
from worker.agent import gangstacks
from worker.agent.channel import Channel
from worker.agent.outbox import Outbox
from worker.agent.running import RunningJob

log = logging.getLogger("tokenpulse.agent")


def retry_after(r: httpx.Response) -> Optional[float]:
    """The server's Retry-After in seconds (bounded to a minute), when it sent one."""
    try:
        return min(max(float(r.headers["retry-after"]), 0.1), 60.0)
    except (KeyError, ValueError):
        return None


def detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail"))[:300]
    except ValueError:
        return r.text[:300]


class ServerLink:
    def __init__(self, server: str, token: str, *, hello: Callable[[], AgentHello], outbox: Outbox,
                 jobs: dict[int, RunningJob], delivering: dict[int, float], flush_now: asyncio.Event,
                 stopped: asyncio.Event, heartbeat_s: float, flush_s: float,
                 on_commands: Callable[[list[Command], float], Awaitable[None]], before_flush: Callable[[], None],
                 held: Optional[Callable[[], list[int]]] = None):
        self.server = server
        self.http = httpx.AsyncClient(base_url=server, timeout=30, headers={"Authorization": f"Bearer {token}"})
        self.hello, self.outbox, self.jobs, self.delivering = hello, outbox, jobs, delivering
        self.heartbeat_s, self.flush_s = heartbeat_s, flush_s
        self.on_commands, self.before_flush = on_commands, before_flush
        # jobs held whose liveness another process reports (a Slurm executor's running jobs)
        self.held = held or (lambda: [])
        self.stopped = stopped  # set when the agent stops: a claim's retries end
        self.agent_id: Optional[int] = None
        self.flush_now = flush_now
        self.beat_now = asyncio.Event()  # a nudge: heartbeat at once (its answer carries the command)
        self.beat_at = 0.0  # monotonic time of the last heartbeat the server answered (alone or folded)
        # One websocket for heartbeats and event batches (HTTP whenever it is down): channel.py
        self.channel = Channel(server, token, lambda: self.agent_id, self.beat_now.set)
        self.unreachable_since: Optional[float] = None  # the server has not answered since then

    # ---- server calls, each retried until the server answers (it may be restarting) ----------

    @overload
    async def call(self, method: str, path: str, until_stopped: Literal[False] = False, **kw) -> httpx.Response: ...

    @overload
    async def call(self, method: str, path: str, until_stopped: bool, **kw) -> Optional[httpx.Response]: ...

    async def call(self, method: str, path: str, until_stopped: bool = False, **kw) -> Optional[httpx.Response]:
        """until_stopped: give up (None) once the agent is stopping: a claim must not keep a stopping
        agent alive while the server is down. Without it, a call returns only with an answer."""
        delay = 0.5
        while True:
            try:
                r = await self.http.request(method, path, **kw)
                self.unreachable_since = None
                if r.status_code < 500:
                    return r
                wait = retry_after(r)
                if wait is not None:  # 503 (database locked) / 507 (its disk full): it says when to retry
                    log.warning("%s %s: server answered %s (%s); retrying in %.0f s", method, path,
                                r.status_code, detail(r), wait)
                    delay = wait
                else:
                    log.warning("%s %s: server answered %s", method, path, r.status_code)
            except httpx.HTTPError as e:
                self.unreachable_since = self.unreachable_since or time.monotonic()
                log.warning("%s %s: %s; retrying", method, path, e)
            if until_stopped:
                try:
                    await asyncio.wait_for(self.stopped.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                if self.stopped.is_set():
                    return None
            else:
                await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def register(self) -> None:
        hello = self.hello()
        r = await self.call("POST", "/api/agents", json=hello.model_dump(), until_stopped=True)
        if r is None:
            return  # stopped before the server ever answered
        if r.status_code in (401, 403):  # a token that may not do this will never may: say why and stop
            is_json = r.headers.get("content-type", "").startswith("application/json")
            detail = r.json().get("detail", r.text) if is_json else r.text
            raise SystemExit(f"the server refused to register this agent ({r.status_code}): {detail}")
        r.raise_for_status()
        self.agent_id = Registered.model_validate(r.json()).id
        log.info("registered as agent %s (%s)%s", self.agent_id, hello.name,
                 "; takes command jobs (--allow-commands)" if hello.accepts_commands else "")

    async def post_system(self, summary: dict) -> None:
        """The machine's readings (the workers page): a live reading, the next one replaces it."""
        try:
            await self.http.post(f"/api/agents/{self.agent_id}/system", json=summary, timeout=5)
        except httpx.HTTPError:
            pass

    async def close(self) -> None:
        await self.http.aclose()

    # ---- heartbeats ------------------------------------------------------------------------------

    def alive_jobs(self) -> dict[str, float]:
        """What a heartbeat says: each job and when its process last said it was alive."""
        beat = {str(jid): at for jid, at in self.delivering.items()}
        beat.update({str(jid): rj.alive_at for jid, rj in self.jobs.items() if not rj.claim.node_rank})
        return beat

    async def heartbeat_loop(self) -> None:
        tried_at = 0.0
        while True:
            nudged = self.beat_now.is_set()
            self.beat_now.clear()
            try:
                # A heartbeat folded into an event batch (send) counts: then none is due here.
                if nudged or time.monotonic() - self.beat_at >= self.heartbeat_s * 0.9:
                    tried_at = time.monotonic()
                    # a multi-node job's share on node rank > 0 is node rank 0's agent's job on the server:
                    # only its ranks are reported (a cancel reaches them through rank 0: they agree on it)
                    beat = Heartbeat(jobs=self.alive_jobs(),
                                     ranks={jid: rj.mask.data(rj.gang.board.rows()) for jid, rj in self.jobs.items()
                                            if rj.gang is not None and rj.gang.board.ranks},  # the rank table
                                     held=self.held())
                    for rj in self.jobs.values():
                        if rj.gang is not None:
                            gangstacks.sent(rj.gang)  # asked-for stacks go once
                    sent = time.monotonic()  # its commands are about what ran then (on_commands)
                    reply = await self.channel.heartbeat(beat)  # rank tables too: one message model
                    if reply is None or "status" in reply:
                        r = await self.call("POST", f"/api/agents/{self.agent_id}/heartbeat",
                                            json=beat.model_dump(exclude_none=True))
                        reply = r.json() if r.status_code == 200 else None
                    if reply is not None:
                        self.beat_at = time.monotonic()
                        await self.on_commands(AgentReply.model_validate(reply).commands, sent)
            except Exception:
                log.exception("heartbeat failed")
            try:
                due_in = max(self.beat_at, tried_at) + self.heartbeat_s - time.monotonic()  # refused: not sooner
                await asyncio.wait_for(self.beat_now.wait(), max(0.05, due_in))
            except asyncio.TimeoutError:
                pass

    # ---- events ----------------------------------------------------------------------------------

    async def take_reply(self, data: dict, sent: float) -> None:
        """The server's answer to an event batch (socket or HTTP) sent at `sent` (monotonic): drop what
        it stored, act on commands."""
        reply = AgentReply.model_validate(data)
        self.outbox.ack(reply.acked)
        await self.on_commands(reply.commands, sent)

    async def send(self, batch: list[dict]) -> bool:
        """POST one batch; True once the server answered it. A batch the server refuses as malformed
        (422) or too large (413) is split in halves until the culprit is one event, which is dropped
        with a log line: one bad event must never hold back every event after it."""
        body = event_batch_body(batch)
        sent = time.monotonic()
        if len(batch) < 1000:  # small batches over the websocket; a refusal is split over HTTP below
            msg: dict = dict(body)
            if time.monotonic() - self.beat_at >= self.heartbeat_s * 0.5 and not any(  # one message, not two
                    rj.gang is not None for rj in self.jobs.values()):  # (rank tables: heartbeat_loop's)
                msg["heartbeat"] = self.alive_jobs()
            got = await self.channel.request(msg)
            if got is not None and "status" not in got:
                if "heartbeat" in msg:
                    self.beat_at = time.monotonic()
                await self.take_reply(got, sent)
                return True
        r = await self.call("POST", f"/api/agents/{self.agent_id}/events", json=body)
        if r.status_code == 200:
            await self.take_reply(r.json(), sent)
            return True
        if r.status_code in (413, 422):
            if len(batch) == 1:
                self.outbox.drop(batch[0], f"{r.status_code} {r.text}")
                return True
            half = len(batch) // 2
            return await self.send(batch[:half]) and await self.send(batch[half:])
        # 401/403 (a revoked token) or 404 (unknown agent): keep everything and try again later
        log.error("events refused (%s): %s", r.status_code, r.text[:500])
        return False

    async def flush_loop(self) -> None:
        """Send pending events in batches about every flush_s (at once for state changes/alerts)."""
        while True:
            try:
                await asyncio.wait_for(self.flush_now.wait(), self.flush_s)
            except asyncio.TimeoutError:
                pass
            self.flush_now.clear()
            try:
                self.outbox.retry_journal()
                self.before_flush()
                while self.outbox.size():
                    batch = self.outbox.batch()
                    if not await self.send(batch):
                        await asyncio.sleep(1)
                        break
                    if len(batch) < 1000:  # a small batch: caught up; more in flush_s
                        break
                for job_id in list(self.outbox.pending):
                    if job_id not in self.jobs:
                        self.outbox.close_job(job_id)
                for job_id in list(self.delivering):
                    if not self.outbox.pending.get(job_id):  # all acknowledged: its end is the server's
                        del self.delivering[job_id]
            except Exception:
                log.exception("flush failed")
                await asyncio.sleep(1)

    async def drain(self, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while self.outbox.size() and time.monotonic() < end:
            if self.unreachable_since is not None and time.monotonic() - self.unreachable_since > 3:
                # the journal keeps them: the next start of this agent sends them
                log.warning("server unreachable: %s events stay in the journal", self.outbox.size())
                return
            self.flush_now.set()
            await asyncio.sleep(0.1)
