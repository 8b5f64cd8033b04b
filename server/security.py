"""Who is calling, and may they: tokens (bearer, cookie, query), CSRF for cookie sessions, the
websocket origin check, the role dependencies routes declare (person, admin, agent, metrics) and
the ownership rule for controlling a job.

Roles (server/auth.py): `admin` may do everything, including managing every token; `user` submits,
watches and controls its own jobs (command jobs only with the `commands` scope); `agent` registers,
claims and reports (command jobs only with `commands`, multi-node jobs only with `gang`); `metrics`
only reads /metrics."""
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
    # Whose jobs and tokens these are: the token itself, or for a token a user minted, that user's
    # token (the same person's CLI token and browser login share their jobs).
    principal_id: int = 0
    # A job's own credential (a Slurm executor's node processes, server/job_tokens.py): it acts as
    # the agent holding that job, for that job alone
    job_id: Optional[int] = None

    def __post_init__(self):
        self.principal_id = self.principal_id or self.token_id

    @property
    def is_admin(self) -> bool:
        return self.role == auth.ADMIN

    @property
    def is_person(self) -> bool:
        return self.role in auth.PERSON_ROLES

    @property
    def may_run_commands(self) -> bool:
        return self.is_admin or (self.role == auth.USER and auth.COMMANDS in self.scopes)

    def owns(self, owner_token_id: Optional[int]) -> bool:
        """May control a job owned by this token id (None: from before owners existed, the admin's)."""
        return self.is_admin or (owner_token_id is not None and owner_token_id == self.principal_id)


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
    """A person: an admin or a user token."""
    caller = _caller(request)
    if not caller.is_person:
        if caller.role == auth.METRICS:
            raise HTTPException(403, "this token is a metrics token: it can only read /metrics")
        raise HTTPException(403, "this token is an agent token: it can only claim jobs and report events")
    return caller


async def require_admin(request: Request) -> Caller:
    caller = await require_user(request)
    if not caller.is_admin:
        raise HTTPException(403, "only an admin token may do this (the token `tokenpulse up` printed at first start, "
                                 "or one an admin created with --role admin)")
    return caller


async def require_metrics(request: Request) -> Caller:
    """Prometheus: a read-only metrics token, or an admin."""
    caller = _caller(request)
    if caller.role not in (auth.METRICS, auth.ADMIN):
        raise HTTPException(403, "/metrics needs a metrics token (`tokenpulse tokens create NAME --role metrics`, "
                                 "by an admin) or an admin token")
    return caller


def not_yours(action: str, what: str, owner_token_id: Optional[int]) -> HTTPException:
    whose = f"token {owner_token_id}'s" if owner_token_id is not None else "the admin's (it predates job owners)"
    return HTTPException(403, f"{action} refused: {what} is {whose}; only the token that submitted it "
                              "(or an admin) may change it")


COMMANDS_REFUSED = ("this token may not submit command jobs: a command job runs code on an agent's machine, "
                    "so it needs a token with the 'commands' scope (admin tokens have "
                    "it; an admin creates others with `tokenpulse tokens create NAME --role user --allow-commands`)")


async def require_commands(request: Request) -> Caller:
    """A user token allowed to run code on agents (the 'commands' scope)."""
    caller = await require_user(request)
    if not caller.may_run_commands:
        raise HTTPException(403, COMMANDS_REFUSED)
    return caller


def require_command_rights(caller: Caller, what: str) -> None:
    """Anything that starts a command job's command again (resume, clone) needs the commands scope."""
    if not caller.may_run_commands:
        raise HTTPException(403, COMMANDS_REFUSED.replace("may not submit command jobs", f"may not {what}"))


async def require_agent(request: Request) -> Caller:  # async: no threadpool hop (the token check is a cached dict hit)
    caller = _caller(request)
    if caller.role != auth.AGENT:
        raise HTTPException(403, "this endpoint is for agents; use an agent token")
    return caller


def confine(caller: Caller, job_ids) -> None:
    """A job's own credential speaks for its job only: anything naming another is refused."""
    if caller.job_id is None:
        return
    others = sorted({int(j) for j in job_ids} - {caller.job_id})
    if others:
        raise HTTPException(403, f"this credential is job {caller.job_id}'s own: it may not act on job {others[0]}")


def no_job_credential(caller: Caller, what: str) -> None:
    if caller.job_id is not None:
        raise HTTPException(403, f"a job's own credential may not {what}; use the agent's token")


def websocket_caller(ws: WebSocket) -> Optional[Caller]:
    """Websockets have no CORS: a page on another site may open one, and the browser sends our
    cookie along. So a cookie (or query) token is only honoured from our own origin."""
    tp = ws.app.state.tp
    scheme = "https" if ws.url.scheme == "wss" else "http"
    if not bearer(ws.headers) and not same_origin(ws.headers, scheme):
        return None
    return tp.caller(token_from(ws.headers, ws.cookies, ws.query_params))


UserDep = Annotated[Caller, Depends(require_user)]
AdminDep = Annotated[Caller, Depends(require_admin)]
MetricsDep = Annotated[Caller, Depends(require_metrics)]
AgentDep = Annotated[Caller, Depends(require_agent)]
CommandsDep = Annotated[Caller, Depends(require_commands)]
