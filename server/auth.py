"""Tokens: people's (role user) and agents' (role agent), stored as SHA-256 hashes; browser
sessions made from a user token at login; a throttle on failed logins.

The first start creates one of each token and writes them, readable only by the owner, into the data
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
ROLES = ("user", "agent")
# Extra rights a user token may hold. "commands": submit command jobs, i.e. run code on agents.
COMMANDS = "commands"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(s: Session, name: str, role: str, scopes: tuple[str, ...] = ()) -> str:
    token = f"tp{role[0]}_" + secrets.token_urlsafe(24)
    s.add(Token(name=name, role=role, hash=hash_token(token), created_at=time.time(), scopes=" ".join(scopes)))
    return token


def scopes_of(row: Token) -> frozenset[str]:
    return frozenset((row.scopes or "").split())


def token_file(data_dir: Path, role: str) -> Path:
    return data_dir / ("token" if role == "user" else "agent_token")


def write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


def ensure_initial_tokens(s: Session, data_dir: Path) -> None:
    """At first start: a user and an agent token; later starts keep the files that still verify.
    The user token may submit command jobs: on one machine, `tokenpulse up` just works."""
    for role in ROLES:
        path = token_file(data_dir, role)
        if path.exists() and lookup(s, path.read_text().strip()) is not None:
            continue
        write_secret(path, new_token(s, f"initial {role}", role, (COMMANDS,) if role == "user" else ()))


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

