"""Request-scoped dependencies: the app's parts and who is calling."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Optional

from fastapi import Depends, HTTPException, Request, WebSocket

from server import auth
from server.db import Database
from server.hub import Hub
from server.prometheus import ServerStats
from server.settings import Settings


@dataclass
class Caller:
    role: str
    token_id: int


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

    def caller(self, token: str) -> Optional[Caller]:
        h = auth.hash_token(token)
        hit = self.token_cache.get(h)
        now = time.monotonic()
        if hit is not None and hit[1] > now:
            return hit[0]
        with self.db.read() as s:
            row = auth.lookup_any(s, token)
            caller = Caller(row.role, row.id) if row is not None else None
        if len(self.token_cache) > 10_000:  # guessed tokens must not grow memory without bound
            self.token_cache.clear()
        self.token_cache[h] = (caller, now + 5.0)  # revocation takes effect within 5 s (at once here)
        return caller

    def forget(self, token: str) -> None:
        """Drop a cached check (a revoked session or token takes effect at once)."""
        self.token_cache.pop(auth.hash_token(token), None)


async def get_app(request: Request) -> App:  # async: a sync dependency costs a threadpool hop per request
    return request.app.state.tp


def bearer(headers) -> str:
    authz = headers.get("authorization", "")
    return authz[7:].strip() if authz.lower().startswith("bearer ") else ""


def token_from(headers, cookies, query) -> str:
    return bearer(headers) or cookies.get(auth.COOKIE) or query.get("token") or ""


def same_origin(headers, scheme: str = "http") -> bool:
    """A browser's Origin header names the page that opened the connection: only our own pages
    may use the session cookie (no Origin at all: not a browser, so no ambient cookie risk). Scheme
    and host must both match: https://host is another origin than http://host."""
    origin = headers.get("origin")
    if not origin:
        return True
    origin_scheme, sep, origin_host = origin.rstrip("/").lower().partition("://")
    if not sep:
        return False  # "null" (a sandboxed frame, a file: page) or garbage
    schemes = {scheme.lower()}  # behind a TLS-terminating proxy: the scheme the browser used
    schemes |= {p.strip().lower() for p in headers.get("x-forwarded-proto", "").split(",") if p.strip()}
    hosts = {headers.get("host", "").lower()}  # behind a reverse proxy: the host the browser used
    hosts |= {h.strip().lower() for h in headers.get("x-forwarded-host", "").split(",") if h.strip()}
    return origin_scheme in schemes and origin_host in hosts


CSRF_HEADER = "x-tokenpulse-csrf"


def _caller(request: Request) -> Caller:
    tp: App = request.app.state.tp
    caller = tp.caller(token_from(request.headers, request.cookies, {}))
    if caller is None:
        raise HTTPException(401, "missing or invalid token: send 'Authorization: Bearer <token>' "
                                 "(the token is in the server's data directory) or log in")
    by_cookie = not bearer(request.headers)  # a malformed Authorization header falls back to the cookie
    if by_cookie and request.method not in ("GET", "HEAD", "OPTIONS"):
        # A cookie rides along on cross-site requests; a custom header cannot be added by another
        # site without a CORS preflight, which this server never grants. So: no header, no change.
        if not request.headers.get(CSRF_HEADER):
            raise HTTPException(403, f"state-changing browser requests need the {CSRF_HEADER} header")
    return caller


async def require_user(request: Request) -> Caller:  # async: no threadpool hop (the token check is a cached dict hit)
    caller = _caller(request)
    if caller.role != "user":
        raise HTTPException(403, "this token is an agent token: it can only claim jobs and report events")
    return caller


async def require_agent(request: Request) -> Caller:  # async: no threadpool hop (the token check is a cached dict hit)
    caller = _caller(request)
    if caller.role != "agent":
        raise HTTPException(403, "this endpoint is for agents; use an agent token")
    return caller


def websocket_caller(ws: WebSocket) -> Optional[Caller]:
    """Websockets have no CORS: a page on another site may open one, and the browser sends our
    cookie along. So a cookie (or query) token is only honoured from our own origin."""
    tp: App = ws.app.state.tp
    scheme = "https" if ws.url.scheme == "wss" else "http"
    if not bearer(ws.headers) and not same_origin(ws.headers, scheme):
        return None
    return tp.caller(token_from(ws.headers, ws.cookies, ws.query_params))


AppDep = Annotated[App, Depends(get_app)]
UserDep = Annotated[Caller, Depends(require_user)]
AgentDep = Annotated[Caller, Depends(require_agent)]
