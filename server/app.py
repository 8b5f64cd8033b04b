"""The FastAPI application: REST under /api, the websocket at /ws, pages and static files."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from starlette.middleware.gzip import GZipMiddleware

from server import attempt_outcomes, auth, errors, prometheus, rules, storage_errors
from server.agent_channel import AgentWrites
from server.api import (
    agent_ws,
    agents,
    alerts,
    datasets,
    external,
    fixes as fixes_api,
    jobs,
    logs as logs_api,
    preflight as preflight_api,
    projects,
    ranks as ranks_api,
    rules as rules_api,
    sweeps as sweeps_api,
    tokens,
    ws,
)
from server.context import App, AppDep
from server.db import Database, upgrade_to_head
from server.destinations import Policy
from server.filemodes import secure_data_dir
from server.hub import Hub
from server.ingest import alerts as ingest_alerts, logcap, metric_names
from server.leader import ReaperLock
from server.reaper import reaper_loop
from server.relay import Relay
from server.rule_runner import RuleRunner
from server.rules import RULES
from server.schemas import Health
from server.security import MetricsDep
from server.settings import Settings
from server.sweeps.engine import SweepEngine
from server.webhooks import Webhooks

log = logging.getLogger("tokenpulse")
WEB_DIR = Path(__file__).resolve().parent.parent / "web"
GZIP_MIN_BYTES = 1024
# Level 1: a 100k-point history (4 MB of JSON) compresses in ~25 ms to 1.32 MB; level 5 took ~90 ms
# for 1.25 MB, most of the read's time (bench/server_load.py).
GZIP_LEVEL = 1


class BodyLimit:
    """Refuse request bodies over the limit with 413: at once when Content-Length says so, and while
    reading when it does not (chunked uploads), so no body of any size is ever buffered whole."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"request body over the server's limit of {self.limit} bytes"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            return await JSONResponse({"detail": message}, 413)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    from starlette.exceptions import HTTPException as StarletteHTTPException
                    raise StarletteHTTPException(413, message)  # FastAPI turns it into the 413 answer
            return msg
        return await self.app(scope, limited, send)


def tune_serving_process() -> None:
    """Process-wide settings a server process chooses for itself at start (tokenpulse/cli.py serve),
    after the app is built; not the app's nor the database's to impose on a process that hosts them
    (tests, benchmarks)."""
    # The writer is CPU-bound Python for tens of ms per big batch; every wake-up of the event
    # loop (a request, a websocket send) must first win the GIL from it. A 1 ms switch interval
    # (default 5) bounds that wait at 1 ms per hand-off: live latency, not throughput.
    sys.setswitchinterval(0.001)
    # The server is built by now (app, routes, models: ~120k objects). Freezing them keeps a full
    # garbage collection, which holds the GIL, from scanning them all: measured 87 ms -> 1 ms,
    # a stall every request and websocket would otherwise feel now and then under ingest.
    gc.freeze()


def create_app(settings: Optional[Settings] = None) -> FastAPI:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        secure_data_dir(settings.data_dir, settings.db_url)  # 0700; the database and its WAL/SHM 0600
        settings.jobs_dir.mkdir(parents=True, exist_ok=True)
        upgrade_to_head(settings.db_url)
        db = Database(settings.db_url, settings.busy_timeout_s)
        db.write_sync(lambda s: auth.ensure_initial_tokens(s, settings.data_dir))
        tp = App(settings=settings, db=db, hub=Hub(settings.ws_queue_frames),
                 webhooks=Webhooks(settings.webhooks, settings.webhook_timeout_s, settings.webhook_retries,
                                   clear_after_s=settings.alert_reopen_s, policy=Policy(settings.webhook_allow),
                                   connections=settings.webhook_connections, queue_size=settings.webhook_queue,
                                   sends_per_event=settings.webhook_sends_per_event))
        ingest_alerts.REOPEN_S = settings.alert_reopen_s
        rules.JUMP_WINDOW = settings.rule_window_values
        metric_names.LIMIT = settings.metric_names_per_job
        attempt_outcomes.MAX_PREEMPTIONS = settings.max_preemptions
        logcap.LIMIT = settings.log_max_bytes
        app.state.tp = tp
        tp.agent_writes = AgentWrites(tp)
        tp.webhooks.channels_for = RULES.channels_for  # a rule's own webhooks (server/rules.py)
        tp.webhooks.start()
        tp.rule_runner = RuleRunner(tp)
        tp.rule_runner.start()
        lock = None
        if db.dialect == "postgresql":  # maybe one of several server processes on this database
            tp.hub.relay = Relay(db.url, tp.hub)
            await tp.hub.relay.start()
            lock = ReaperLock(db.url)
        app.state.reaper_lock = lock
        reaper = asyncio.create_task(reaper_loop(tp, lock))
        tp.sweeps = SweepEngine(tp)
        sweep_loop = asyncio.create_task(tp.sweeps.run(lock))  # on PostgreSQL: the reaper's process alone
        try:
            yield
        finally:
            reaper.cancel()
            sweep_loop.cancel()
            if lock is not None:
                await lock.close()
            if tp.hub.relay is not None:
                await tp.hub.relay.stop()
            tp.rule_runner.stop()
            await tp.webhooks.stop()
            db.close()

    # /docs is served from our own copy of Swagger UI (web/static/vendor), never a CDN: it works on a
    # machine without internet. ReDoc would need a CDN too, so it is off.
    app = FastAPI(title="tokenpulse", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Run, watch and control model training.")
    errors.install(app)  # one 422 shape (server/errors.py); a refused transition is a 409
    storage_errors.install(app, settings.db_url)  # disk full: 507; locked past the busy timeout: 503

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    # Answers over a few KB are gzipped for clients that accept it: a long job's metrics JSON shrinks
    # to about a third, pages and scripts likewise.
    app.add_middleware(GZipMiddleware, minimum_size=GZIP_MIN_BYTES, compresslevel=GZIP_LEVEL)

    for r in (external.router, logs_api.router, jobs.router, fixes_api.router, ranks_api.router, preflight_api.router,
              agents.router, agent_ws.router, alerts.router,
              rules_api.router, projects.router, sweeps_api.router,
              datasets.router, tokens.router, ws.router):
        app.include_router(r)

    @app.get("/metrics", tags=["meta"], response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    def metrics(_: MetricsDep, tp: AppDep) -> PlainTextResponse:
        """Prometheus metrics: jobs, agents and open alerts by state, points and events stored,
        writer queue depth, websocket clients. Scrape with a metrics token (read-only, `tokenpulse
        tokens create prometheus --role metrics`) or an admin token (bearer)."""
        return PlainTextResponse(prometheus.exposition(tp), media_type=prometheus.CONTENT_TYPE)

    @app.get("/api/health", tags=["meta"])
    def health(request: Request) -> Health:
        """reaper: whether this server process runs the reaper (one of several on PostgreSQL does)."""
        lock = getattr(request.app.state, "reaper_lock", None)
        return {"ok": True, "reaper": lock is None or lock.held}

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url, title="tokenpulse API",
            swagger_js_url="/static/vendor/swagger-ui-bundle.js", swagger_css_url="/static/vendor/swagger-ui.css",
            swagger_favicon_url="/static/vendor/swagger-ui-favicon-32x32.png",
            swagger_ui_parameters={"validatorUrl": None})  # the validator badge would call validator.swagger.io

    from starlette.exceptions import HTTPException as StarletteHTTPException

    from web.pages import not_found, router as pages_router
    app.include_router(pages_router)
    app.add_exception_handler(StarletteHTTPException, not_found)  # a browser's unknown route: our 404 page
    app.mount("/static", StaticFiles(directory=WEB_DIR / "static"), name="static")
    return app
