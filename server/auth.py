"""Tokens and their roles, stored as SHA-256 hashes; browser sessions made from a person's token at
login; a throttle on failed logins.

Roles: `admin` (everything, every token), `user` (its own jobs and tokens; command jobs only with
the `commands` scope), `agent` (register, claim, report; command jobs only with `commands`,
multi-node jobs only with `gang`), `metrics` (reads /metrics, nothing else). A user may mint only
user tokens for itself, with no right it lacks; they belong to it (same jobs), it lists and revokes
them, and they stop working when it is revoked.

The first start creates an admin and an agent token (commands + gang: `tokenpulse up` is one
machine owned by its admin) and writes them, readable only by the owner, into the data
directory, where `tokenpulse` commands on the same machine find them. The login cookie never holds
a token: it holds a session secret that logout revokes and that expires, so a stolen cookie is not
a permanent key.
"""
from __future__ import annotations

import collections
import hashlib
import os
import secrets
import time
from pathlib import Path
from typing import Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.models import BrowserSession, Token

COOKIE = "tokenpulse_session"
SESSION_PREFIX = "tps_"
ADMIN, USER, AGENT, METRICS = "admin", "user", "agent", "metrics"
ROLES = (ADMIN, USER, AGENT, METRICS)
PERSON_ROLES = (ADMIN, USER)  # may log in, watch, submit
PREFIX = {ADMIN: "tpk_", USER: "tpu_", AGENT: "tpa_", METRICS: "tpm_"}
# Extra rights. "commands": a user submits command jobs (runs code on agents), an agent takes them.
# "gang": an agent joins multi-node jobs (node rank 0 can run code in the other ranks: trust).
COMMANDS = "commands"
GANG = "gang"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(s: Session, name: str, role: str, scopes: tuple[str, ...] = (), created_by: Optional[int] = None) -> str:
    token = PREFIX[role] + secrets.token_urlsafe(24)
    s.add(Token(name=name, role=role, hash=hash_token(token), created_at=time.time(), scopes=" ".join(scopes),
                created_by=created_by))
    return token


def scopes_of(row: Token) -> frozenset[str]:
    return frozenset((row.scopes or "").split())


def principal(s: Session, row: Token) -> Optional[int]:
    """Whose the token is: a user-minted token belongs to its user (None: that user is revoked, so
    is the token); any other token to itself."""
    if row.role != USER or row.created_by is None:
        return row.id
    maker = s.get(Token, row.created_by)
    if maker is None or maker.role != USER:
        return row.id  # minted by an admin: its own principal
    return maker.id if maker.revoked_at is None else None


def token_file(data_dir: Path, role: str) -> Path:
    return data_dir / ("token" if role == ADMIN else "agent_token")


def write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


def ensure_initial_tokens(s: Session, data_dir: Path) -> None:
    """At first start: an admin and an agent token; later starts keep the files that still verify.
    The agent token takes command and multi-node jobs: on one machine, `tokenpulse up` just works."""
    for role, scopes in ((ADMIN, (COMMANDS,)), (AGENT, (COMMANDS, GANG))):
        path = token_file(data_dir, role)
        if path.exists() and lookup(s, path.read_text().strip()) is not None:
            continue
        write_secret(path, new_token(s, f"initial {role}", role, scopes))


def lookup(s: Session, token: str) -> Optional[Token]:
    if not token:
        return None
    row = s.scalar(select(Token).where(Token.hash == hash_token(token)))
    if row is None or row.revoked_at is not None:
        return None
    return row


def new_session(s: Session, token: Token, ttl_s: float) -> str:
    secret = SESSION_PREFIX + secrets.token_urlsafe(32)
    now = time.time()
    s.add(BrowserSession(hash=hash_token(secret), token_id=token.id, created_at=now, expires_at=now + ttl_s))
    return secret


def lookup_session(s: Session, secret: str) -> Optional[Token]:
    """The token behind a live session: not revoked, not expired, and its token not revoked."""
    row = s.scalar(select(BrowserSession).where(BrowserSession.hash == hash_token(secret)))
    if row is None or row.revoked_at is not None or row.expires_at <= time.time():
        return None
    token = s.get(Token, row.token_id)
    return token if token is not None and token.revoked_at is None else None


def revoke_session(s: Session, secret: str) -> None:
    row = s.scalar(select(BrowserSession).where(BrowserSession.hash == hash_token(secret)))
    if row is not None and row.revoked_at is None:
        row.revoked_at = time.time()


def lookup_any(s: Session, secret: str) -> Optional[Token]:
    """A bearer token, or the session a login cookie names."""
    return lookup_session(s, secret) if secret.startswith(SESSION_PREFIX) else lookup(s, secret)


class LoginThrottle:
    """At most `limit` failed logins per client address in `window_s`; then 429 until the oldest
    failure leaves the window. Guessing a 190-bit token is hopeless anyway: this keeps a script from
    hammering the form (and the database) and makes the attempt visible in the log."""

    def __init__(self, limit: int = 5, window_s: float = 60.0):
        self.limit, self.window_s = limit, window_s
        self.failures: dict[str, collections.deque] = {}

    def retry_after(self, client: str) -> float:
        """Seconds until this client may try again (0: now)."""
        q = self.failures.get(client)
        now = time.monotonic()
        while q and q[0] <= now - self.window_s:
            q.popleft()
        if not q:
            self.failures.pop(client, None)
            return 0.0
        return max(0.0, q[0] + self.window_s - now) if len(q) >= self.limit else 0.0

    def failed(self, client: str) -> None:
        if len(self.failures) > 10_000:  # many addresses: forget, rather than grow without bound
            self.failures.clear()
        self.failures.setdefault(client, collections.deque()).append(time.monotonic())

