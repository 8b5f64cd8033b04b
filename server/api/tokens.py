"""Tokens for people and agents: create, list, revoke. Only a user token may manage them."""
from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import select

from server import auth
from server.context import AppDep
from server.errors import unprocessable
from server.security import COMMANDS_REFUSED, UserDep
from server.models import Token
from server.schemas import NewTokenOut, TokenOut

router = APIRouter(prefix="/api/tokens", tags=["tokens"])


class NewToken(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    role: Literal["user", "agent"]
    allow_commands: bool = Field(False, description="a user token that may submit command jobs (code "
                                                    "execution on agents); only such a token may grant it")


def token_dict(t: Token) -> dict:
    return {"id": t.id, "name": t.name, "role": t.role, "scopes": sorted(auth.scopes_of(t)),
            "created_at": t.created_at, "revoked_at": t.revoked_at}


@router.post("", status_code=201)
async def create_token(body: NewToken, tp: AppDep, caller: UserDep) -> NewTokenOut:
    """A new token, shown once. `allow_commands` (user tokens only) lets it submit command jobs; a
    token can only hand out that right if it has it itself."""
    if body.allow_commands and body.role != "user":
        raise unprocessable([{"field": "allow_commands", "message": "only user tokens submit jobs; an agent takes "
                              "command jobs when started with --allow-commands"}])
    if body.allow_commands and not caller.may_run_commands:
        raise HTTPException(403, COMMANDS_REFUSED.replace("submit command jobs", "grant the right to submit command jobs"))

    def make(s):
        token = auth.new_token(s, body.name, body.role, (auth.COMMANDS,) if body.allow_commands else ())
        s.flush()
        row = s.scalar(select(Token).where(Token.hash == auth.hash_token(token)))
        return {**token_dict(row), "token": token}
    return await tp.db.write(make)  # the only time the token itself is shown


@router.get("")
def list_tokens(tp: AppDep, _: UserDep) -> list[TokenOut]:
    with tp.db.read() as s:
        return [token_dict(t) for t in s.scalars(select(Token).order_by(Token.id))]


@router.post("/{token_id}/revoke")
async def revoke_token(token_id: int, tp: AppDep, _: UserDep) -> TokenOut:
    def revoke(s):
        t = s.get(Token, token_id)
        if t is None:
            raise HTTPException(404, f"token {token_id} does not exist")
        if t.revoked_at is None:
            t.revoked_at = time.time()
        return token_dict(t)
    d = await tp.db.write(revoke)
    tp.token_cache.clear()
    return d
