"""The app's parts, built once at start (app.state.tp), and the dependency that hands them to a route."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Optional

from fastapi import Depends, Request

from server import auth, job_tokens
from server.db import Database
from server.hub import Hub
from server.ingest.heartbeats import Arriving, Deliveries, LoopPauses
from server.prometheus import ServerStats
from server.security import Caller
from server.settings import Settings


@dataclass
class App:
    """Everything a route needs, built once at start (app.state.tp)."""
    settings: Settings
    db: Database
    hub: Hub
    # token hash -> (caller, cached until): a token check per request must not cost a query.
    token_cache: dict[str, tuple[Optional[Caller], float]] = field(default_factory=dict)
    webhooks: object = None
    started_at: float = field(default_factory=time.time)  # leases count from here after a restart
    login_throttle: auth.LoginThrottle = field(default_factory=auth.LoginThrottle)
    stats: ServerStats = field(default_factory=ServerStats)  # counters /metrics exposes
    agent_writes: object = None  # agent websockets' writes, batched (server/agent_channel.py)
    rule_runner: object = None  # metric rules judged after ingest's commit (server/rule_runner.py)
    deliveries: Deliveries = field(default_factory=Deliveries)  # jobs' events arriving (store.reconcile)
    arriving: Arriving = field(default_factory=Arriving)  # agents' messages not yet applied (the reaper)
    pauses: LoopPauses = field(default_factory=LoopPauses)  # this process's event loop stood still (the reaper)
    sweeps: object = None  # the sweep loop (server/sweeps/engine.py): woken when a trial's events arrive

    def caller(self, token: str) -> Optional[Caller]:
        h = auth.hash_token(token)
        hit = self.token_cache.get(h)
        now = time.monotonic()
        if hit is not None and hit[1] > now:
            return hit[0]
        if token.startswith(job_tokens.PREFIX):
            caller = job_tokens.caller(self.db, token)
            self.token_cache[h] = (caller, now + 5.0)  # dies within 5 s of its attempt's end
            return caller
        with self.db.read() as s:
            row = auth.lookup_any(s, token)
            owner = auth.principal(s, row) if row is not None else None
            caller = Caller(row.role, row.id, auth.scopes_of(row), owner) if owner is not None else None
        if len(self.token_cache) > 10_000:  # guessed tokens must not grow memory without bound
            self.token_cache.clear()
        self.token_cache[h] = (caller, now + 5.0)  # revocation takes effect within 5 s (at once here)
        return caller

    def forget(self, token: str) -> None:
        """Drop a cached check (a revoked session or token takes effect at once)."""
        self.token_cache.pop(auth.hash_token(token), None)


async def get_app(request: Request) -> App:  # async: a sync dependency costs a threadpool hop per request
    return request.app.state.tp


AppDep = Annotated[App, Depends(get_app)]
