"""Error answers in one place: every 422 has one shape, and a refused state change is a 409.

A 422 body is {"detail": {"message", "field", "errors": [{"field", "message"}]}}: `field` names the
first bad field (the UI puts the message beside that input), `errors` lists each field once.
"""
from __future__ import annotations

from typing import Iterable, Optional

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError

from server.store import TransitionError
from server.validate import SpecError


def field_name(loc: Iterable) -> str:
    """A pydantic error location -> the dotted field a person would name."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    # pydantic adds the union member tried ('int', 'literal[...]') to the location: drop it
    parts = [p for p in parts if not (p in ("int", "float", "str") or p.startswith(("literal[", "function-")))]
    return ".".join(parts) or "body"


def error_list(pydantic_errors: Iterable[dict], default_field: str = "body") -> list[dict]:
    """pydantic's errors() -> [{"field", "message"}], one entry per field."""
    out: list[dict] = []
    for e in pydantic_errors:
        loc = tuple(e.get("loc", ()))
        field = field_name(loc) if loc else default_field
        if field == "body":
            field = default_field
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if not any(x["field"] == field for x in out):
            out.append({"field": field, "message": msg})
    return out


def error_detail(errors: list[dict], message: Optional[str] = None, field: Optional[str] = "first") -> dict:
    """The 422 detail. message: default every "field: message" joined; field: default the first's."""
    if message is None:
        message = "; ".join(f"{x['field']}: {x['message']}" for x in errors)
    if field == "first":
        field = errors[0]["field"] if errors else None
    return {"message": message, "field": field, "errors": errors}


def unprocessable(errors: list[dict], message: Optional[str] = None) -> HTTPException:
    """A 422 a route raises itself (an edited clone's spec, the analysis child's verdict)."""
    return HTTPException(422, error_detail(errors, message))


def invalid_body(loc: tuple, msg: str) -> RequestValidationError:
    """A body error found by hand (the agent's batch parser): answered like pydantic's own."""
    return RequestValidationError([{"loc": ("body",) + loc, "msg": msg, "type": "value_error"}])


def answer_422(detail: dict) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=422)


async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return answer_422(error_detail(error_list(exc.errors())))


async def out_of_range(_: Request, exc: OverflowError) -> JSONResponse:
    """An id or number past SQLite's 64-bit integers (a fuzzer's favourite): the caller's mistake."""
    message = "a number in the request is out of range (integers are at most 2**63 - 1)"
    return answer_422(error_detail([{"field": "body", "message": message}], message, field=None))


async def spec_refused(_: Request, exc: SpecError) -> JSONResponse:
    """A spec that parses but cannot run here (server/validate.py: paths, files, columns, gates)."""
    return answer_422(error_detail([{"field": exc.field, "message": exc.message}], exc.message))


async def transition_refused(_: Request, exc: TransitionError) -> JSONResponse:
    """The state machine said no (cancel a finished job, resume a running one...): a conflict."""
    return JSONResponse({"detail": str(exc)}, status_code=409)


async def unstorable(_: Request, exc: DataError) -> JSONResponse:
    """PostgreSQL refuses what SQLite stores or refuses earlier (OverflowError): an integer past 64
    bits, a NUL character in text. Either is the request's, never a 500."""
    message = ("a value in the request cannot be stored (integers are at most 2**63 - 1; text cannot "
               f"contain NUL characters): {str(exc.orig).splitlines()[0][:200]}")
    return answer_422(error_detail([{"field": "body", "message": message}], message, field=None))


def install(app) -> None:
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(OverflowError, out_of_range)
    app.add_exception_handler(DataError, unstorable)
    app.add_exception_handler(SpecError, spec_refused)
    app.add_exception_handler(TransitionError, transition_refused)
