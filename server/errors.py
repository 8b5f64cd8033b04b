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
from server.validate import every_spec_error_async
from tokenpulse.errors import SpecError
from tokenpulse.protocol import CommandSpec, JobSpec


def field_name(loc: Iterable) -> str:
    """A pydantic error location -> the dotted field a person would name."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    # pydantic adds the union member tried ('int', 'literal[...]') to the location: drop it
    parts = [p for p in parts if not (p in ("int", "float", "str") or p.startswith(("literal[", "function-")))]
    return ".".join(parts) or "body"


def accepted(e: dict) -> Optional[str]:
    """What a pydantic error says the field accepts, in plain words ("a whole number", "at least 1",
    "'auto'"); None when the error is not about the kind or range of a value."""
    kind, ctx = e.get("type", ""), e.get("ctx") or {}
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return "a whole number"
    if kind == "finite_number":
        return "a finite number (not NaN or infinity)"
    if kind in ("float_parsing", "float_type"):
        return "a number"
    if kind in ("bool_parsing", "bool_type"):
        return "true or false"
    if kind == "literal_error":
        return ctx.get("expected", "one of the listed values")
    bounds = {"greater_than_equal": ("at least", "ge"), "less_than_equal": ("at most", "le"),
              "greater_than": ("more than", "gt"), "less_than": ("less than", "lt")}
    if kind in bounds:
        words, key = bounds[kind]
        return f"{words} {ctx.get(key)}"
    if kind in ("string_type",):
        return "text"
    if kind in ("list_type",):
        return "a list"
    if kind in ("dict_type", "model_type"):
        return "an object with named settings"
    return None


def plain_message(errors: list[dict]) -> str:
    """One field's pydantic errors as one sentence. A field that is a union (an integer or 'auto')
    gets an error per member: they are alternatives, so they are joined with "or"."""
    kinds = [accepted(e) for e in errors]
    if all(kinds):
        return "must be " + " or ".join(dict.fromkeys(kinds))
    e = next(e for e, k in zip(errors, kinds) if not k)
    kind, ctx = e.get("type", ""), e.get("ctx") or {}
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "is not a setting this accepts (a misspelt name?)"
    if kind == "too_short":
        n = ctx.get("min_length", 1)
        return "must not be empty" if n == 1 else f"must have at least {n} items"
    if kind == "too_long":
        return f"must have at most {ctx.get('max_length')} items"
    if kind == "string_too_short":
        least = ctx.get("min_length", 1)
        return "must not be empty" if least == 1 else f"must be at least {least} characters"
    if kind == "string_too_long":
        return f"must be at most {ctx.get('max_length')} characters"
    return str(e.get("msg", "invalid")).removeprefix("Value error, ")


def error_list(pydantic_errors: Iterable[dict], default_field: str = "body") -> list[dict]:
    """pydantic's errors() -> [{"field", "message"}], one entry per field, in plain words."""
    by_field: dict[str, list[dict]] = {}
    for e in pydantic_errors:
        loc = tuple(e.get("loc", ()))
        field = field_name(loc) if loc else default_field
        if field == "body":
            field = default_field
        by_field.setdefault(field, []).append(e)
    return [{"field": f, "message": plain_message(errs)} for f, errs in by_field.items()]


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


# Routes whose body is a spec with files to check: a schema error there is answered with the files'
# errors too (a missing dataset named together with a bad number, not after it is fixed).
SPEC_ROUTES = {"/api/jobs": JobSpec, "/api/jobs/command": CommandSpec, "/api/datasets/analyze": JobSpec}


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = error_list(exc.errors())
    model = SPEC_ROUTES.get(request.url.path) if request.method == "POST" else None
    body = getattr(exc, "body", None)
    if model is not None and isinstance(body, dict) and hasattr(request.app.state, "tp"):
        bad = {e["field"].split(".")[0] for e in errors}
        errors += [x for x in await every_spec_error_async(body, model, request.app.state.tp.settings, bad)
                   if x["field"] not in {e["field"] for e in errors}]
    return answer_422(error_detail(errors))


async def out_of_range(_: Request, exc: OverflowError) -> JSONResponse:
    """An id or number past SQLite's 64-bit integers (a fuzzer's favourite): the caller's mistake."""
    message = "a number in the request is out of range (integers are at most 2**63 - 1)"
    return answer_422(error_detail([{"field": "body", "message": message}], message, field=None))


async def spec_refused(_: Request, exc: SpecError) -> JSONResponse:
    """A spec that parses but cannot run here (server/validate.py: paths, files, columns, gates)."""
    return answer_422(error_detail(exc.errors, exc.message if len(exc.errors) == 1 else None))


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
