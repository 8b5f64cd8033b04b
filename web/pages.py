"""Pages a person sees. Each is a Jinja2 template plus static JS that uses the same REST and
websocket API as scripts; the pages themselves hold no data, so they stay fast and cacheable."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates

from server import auth
from server.deps import token_from

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=Path(__file__).resolve().parent / "templates")


def logged_in(request: Request) -> bool:
    caller = request.app.state.tp.caller(token_from(request.headers, request.cookies, {}))
    return caller is not None and caller.role == "user"


def page(request: Request, name: str, **ctx):
    if not logged_in(request):
        return RedirectResponse(f"/login?next={request.url.path}", status_code=303)
    return templates.TemplateResponse(request, name, {"page": name.removesuffix(".html"), **ctx})


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, next: str = "/", error: str = ""):
    return templates.TemplateResponse(request, "login.html", {"next": next, "error": error, "page": "login"})


@router.post("/login")
def login(request: Request, token: str = Form(..., max_length=500), next: str = Form("/")):
    caller = request.app.state.tp.caller(token.strip())
    if caller is None or caller.role != "user":
        return templates.TemplateResponse(
            request, "login.html", {"next": next, "page": "login",
                                    "error": "That token is not valid. It is in the server's data directory, file 'token'."},
            status_code=401)
    target = next if next.startswith("/") and not next.startswith("//") else "/"
    resp = RedirectResponse(target, status_code=303)
    resp.set_cookie(auth.COOKIE, token.strip(), httponly=True, samesite="strict", max_age=30 * 86400)
    return resp


@router.get("/logout")
def logout():
    resp = RedirectResponse("/login", status_code=303)
    resp.delete_cookie(auth.COOKIE)
    return resp


@router.get("/", response_class=HTMLResponse)
def jobs_page(request: Request):
    return page(request, "jobs.html")


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job_id: int):
    return page(request, "job.html", job_id=job_id)


@router.get("/submit", response_class=HTMLResponse)
def submit_page(request: Request, clone: int | None = None):
    return page(request, "submit.html", clone=clone)


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request):
    return page(request, "compare.html")


@router.get("/workers", response_class=HTMLResponse)
def workers_page(request: Request):
    return page(request, "workers.html")
