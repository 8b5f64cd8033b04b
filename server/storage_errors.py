"""The database's own troubles answered as what they are, not as bare 500s:
- a full disk (SQLITE_FULL, "database or disk is full"): 507 naming the disk and the database file;
- a database locked by another process for longer than the busy timeout ("database is locked"):
  503 with Retry-After.
Both carry Retry-After: a real agent waits that long and tries again (it keeps its events in its
journal), and a write stall here is not its silence (server/reaper.py extends leases by it)."""
from __future__ import annotations

import logging
import sqlite3
import time
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

from tokenpulse.protocol import AlertKind

log = logging.getLogger("tokenpulse")

FULL_RETRY_S = 10
LOCKED_RETRY_S = 2
_last_logged: dict[str, float] = {}


def kind_of(exc: BaseException) -> Optional[str]:
    """'full', 'locked', or None for any other database error."""
    text = str(getattr(exc, "orig", None) or exc).lower()
    if "database or disk is full" in text or "no space left" in text:
        return "full"
    if "database is locked" in text or "database is busy" in text or "database table is locked" in text:
        return "locked"
    return None


def _log_once_in_a_while(kind: str, message: str) -> None:
    now = time.monotonic()
    if now - _last_logged.get(kind, -1e9) > 10:  # a flood of agents must not flood the log too
        _last_logged[kind] = now
        log.error("%s", message)


def storage_error_handler(db_path: Optional[str]):
    where = f" ({db_path})" if db_path else ""

    async def handler(request: Request, exc: Exception) -> JSONResponse:
        kind = kind_of(exc)
        if kind == "full":
            message = (f"the server's disk is full: no space left to write the database{where}; "
                       f"writes resume once space is freed")
            status, retry = 507, FULL_RETRY_S
        elif kind == "locked":
            message = (f"the database{where} is locked by another process for longer than the busy "
                       f"timeout; try again shortly")
            status, retry = 503, LOCKED_RETRY_S
        else:
            log.exception("database error on %s %s", request.method, request.url.path, exc_info=exc)
            return JSONResponse({"detail": "internal database error"}, status_code=500)
        _log_once_in_a_while(kind, f"{request.method} {request.url.path}: {message}")
        tp = getattr(request.app.state, "tp", None)
        if tp is not None:
            open_outage(tp, kind, message)
        return JSONResponse({"detail": message}, status_code=status, headers={"Retry-After": str(retry)})
    return handler


def install(app, db_url: str) -> None:
    from sqlalchemy.engine import make_url
    handler = storage_error_handler(make_url(db_url).database if db_url.startswith("sqlite") else None)
    app.add_exception_handler(OperationalError, handler)
    app.add_exception_handler(sqlite3.OperationalError, handler)


def open_outage(tp, kind: str, message: str) -> None:
    """The database cannot store an alert about itself: webhooks carry it (once per outage)."""
    if kind in tp.db.outages:
        return
    # The same trouble back within the reopen window (a lock that comes and goes) is the same alert:
    # its id again, so the webhook's held clear is withdrawn instead of a new open being sent.
    recent = tp.db.outages_cleared.get(kind)
    if recent is not None and time.time() - recent[1] < tp.settings.alert_reopen_s:
        alert = {**recent[0], "state": "open", "message": message}
    else:
        alert = {"id": f"server-db-{kind}-{int(time.time())}", "job_id": None, "kind": AlertKind.DISK_FULL
                 if kind == "full" else AlertKind.DATABASE_LOCKED, "severity": "critical" if kind == "full"
                 else "warning", "state": "open", "message": message, "created_at": time.time()}
    tp.db.outages[kind] = alert
    if tp.webhooks is not None:
        tp.webhooks.send(alert)


def clear_outages(tp) -> None:
    """Called by the reaper after each pass that went through: writes work again."""
    if not tp.db.outages or tp.db.in_stall:
        return
    tp.db.outages_cleared = {k: (a, time.time()) for k, a in tp.db.outages.items()}
    for alert in tp.db.outages.values():
        log.warning("database writable again (%s over)", alert["kind"])
        if tp.webhooks is not None:
            tp.webhooks.send({**alert, "state": "cleared", "message": "the server stores writes again"})
    tp.db.outages.clear()
