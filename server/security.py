"""Who is calling, and may they: tokens (bearer, cookie, query), CSRF for cookie sessions, the
websocket origin check, and the user/agent role dependencies routes declare."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Optional

from fastapi import Depends, HTTPException, Request, WebSocket

from server import auth


@dataclass
class Caller:
    role: str
    token_id: int
    scopes: frozenset = frozenset()

    @property
    def may_run_commands(self) -> bool:
        return self.role == "user" and auth.COMMANDS in self.scopes


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
    tp = request.app.state.tp  # a server.context.App
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


COMMANDS_REFUSED = ("this token may not submit command jobs: a command job runs code on an agent's machine, "
                    "so it needs a token with the 'commands' scope (the user token made at first start has "
                    "it; create another with `tokenpulse tokens create NAME --role user --allow-commands`)")


async def require_commands(request: Request) -> Caller:
    """A user token allowed to run code on agents (the 'commands' scope)."""
    caller = await require_user(request)
    if not caller.may_run_commands:
        raise HTTPException(403, COMMANDS_REFUSED)
    return caller


async def require_agent(request: Request) -> Caller:  # async: no threadpool hop (the token check is a cached dict hit)
    caller = _caller(request)
    if caller.role != "agent":
        raise HTTPException(403, "this endpoint is for agents; use an agent token")
    return caller


def websocket_caller(ws: WebSocket) -> Optional[Caller]:
    """Websockets have no CORS: a page on another site may open one, and the browser sends our
    cookie along. So a cookie (or query) token is only honoured from our own origin."""
    tp = ws.app.state.tp
    scheme = "https" if ws.url.scheme == "wss" else "http"
    if not bearer(ws.headers) and not same_origin(ws.headers, scheme):
        return None
    return tp.caller(token_from(ws.headers, ws.cookies, ws.query_params))


UserDep = Annotated[Caller, Depends(require_user)]
AgentDep = Annotated[Caller, Depends(require_agent)]
CommandsDep = Annotated[Caller, Depends(require_commands)]
