"""Tokens: create, list, revoke. An admin manages every token; a user only its own (itself and the
user tokens it minted for itself, with no right it lacks). Agents and metrics tokens manage none."""
from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, or_, select

from server import auth
from server.context import AppDep
from server.errors import unprocessable
from server.models import Token
from server.schemas import Me, NewTokenOut, TokenOut
from server.security import COMMANDS_REFUSED, Caller, UserDep

router = APIRouter(prefix="/api/tokens", tags=["tokens"])


class NewToken(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    role: Literal["admin", "user", "agent", "metrics"]
    allow_commands: bool = Field(False, description="a user token that may submit command jobs, or an agent token "
                                                    "that may take them (code execution on agents)")
    gang: bool = Field(False, description="an agent token that may join multi-node jobs (admins only: node rank 0 "
                                          "can run code in the other nodes' ranks)")


def token_dict(t: Token) -> dict:
    return {"id": t.id, "name": t.name, "role": t.role, "scopes": sorted(auth.scopes_of(t)),
            "created_by": t.created_by, "created_at": t.created_at, "revoked_at": t.revoked_at}


def check_may_mint(body: NewToken, caller: Caller) -> None:
    if body.allow_commands and body.role not in (auth.USER, auth.AGENT):
        raise unprocessable([{"field": "allow_commands", "message": f"only user and agent tokens take it; "
                              f"a {body.role} token "
                              f"{'has every right' if body.role == auth.ADMIN else 'only reads /metrics'}"}])
    if body.gang and body.role != auth.AGENT:
        raise unprocessable([{"field": "gang", "message": "only agent tokens join multi-node jobs"}])
    if caller.is_admin:
        return
    if body.role != auth.USER:
        raise HTTPException(403, f"only an admin may create {body.role} tokens; a user may create user tokens "
                                 "for itself (field 'role')")
    if body.allow_commands and not caller.may_run_commands:
        raise HTTPException(403,
                            COMMANDS_REFUSED.replace("submit command jobs", "grant the right to submit command jobs"))


@router.post("", status_code=201)
async def create_token(body: NewToken, tp: AppDep, caller: UserDep) -> NewTokenOut:
    """A new token, shown once. An admin creates any role; a user creates user tokens that are its
    own (its jobs, revoked with it) and hold no right it lacks. `allow_commands`: a user token may
    submit command jobs, an agent token may take them; `gang`: an agent token may join multi-node jobs."""
    check_may_mint(body, caller)
    scopes = tuple(x for x, on in ((auth.COMMANDS, body.allow_commands), (auth.GANG, body.gang)) if on)

    def make(s):
        token = auth.new_token(s, body.name, body.role, scopes, created_by=caller.principal_id)
        s.flush()
        row = s.scalar(select(Token).where(Token.hash == auth.hash_token(token)))
        return {**token_dict(row), "token": token}
    return await tp.db.write(make)  # the only time the token itself is shown


@router.get("/me")
async def who_am_i(caller: UserDep) -> Me:
    """The calling token: its role, rights and whose jobs are its own (the `owner` of a job)."""
    return {"id": caller.token_id, "role": caller.role, "scopes": sorted(caller.scopes),
            "principal": caller.principal_id, "may_run_commands": caller.may_run_commands}


def visible(caller: Caller):
    """The tokens a caller manages: every one for an admin; for a user, itself and those it minted."""
    if caller.is_admin:
        return True
    return or_(Token.id == caller.principal_id, Token.created_by == caller.principal_id)


@router.get("")
def list_tokens(tp: AppDep, caller: UserDep) -> list[TokenOut]:
    """Every token for an admin; a user sees its own (itself and the tokens it minted)."""
    with tp.db.read() as s:
        return [token_dict(t) for t in s.scalars(select(Token).where(visible(caller)).order_by(Token.id))]


@router.post("/{token_id}/revoke")
async def revoke_token(token_id: int, tp: AppDep, caller: UserDep) -> TokenOut:
    """An admin revokes any token but the last live admin one; a user only its own."""
    def revoke(s):
        t = s.scalar(select(Token).where(Token.id == token_id, visible(caller)))
        if t is None:
            if not caller.is_admin and s.get(Token, token_id) is not None:
                raise HTTPException(403, f"token {token_id} is not yours: a user revokes only itself and the tokens "
                                         "it created; ask an admin")
            raise HTTPException(404, f"token {token_id} does not exist")
        if t.revoked_at is None and t.role == auth.ADMIN and s.scalar(
                select(func.count()).select_from(Token).where(Token.role == auth.ADMIN,
                                                              Token.revoked_at.is_(None))) <= 1:
            raise HTTPException(409, f"token {token_id} is the last admin token: create another admin token first "
                                     "(nobody could manage tokens otherwise)")
        if t.revoked_at is None:
            t.revoked_at = time.time()
        return token_dict(t)
    d = await tp.db.write(revoke)
    tp.token_cache.clear()
    return d
