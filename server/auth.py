"""Tokens: people's (role user) and agents' (role agent), stored as SHA-256 hashes.

The first start creates one of each and writes them, readable only by the owner, into the data
directory, where `tokenpulse` commands on the same machine find them.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import time
from pathlib import Path
from typing import Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.models import Token

COOKIE = "tokenpulse_token"
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
