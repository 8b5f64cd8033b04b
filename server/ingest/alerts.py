"""Alerts from agents (and the reaper): one open alert per (job, kind); a repeat updates it, a
clear closes it and says so. An alert cleared less than REOPEN_S ago and raised again with the same
kind reopens the same row (the same id): a condition that comes back at once is the same condition,
and webhooks (server/webhooks.py) hold a clear for as long, so its receivers see one open and one
clear."""
from __future__ import annotations

import json
import time
from typing import Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.models import Alert

REOPEN_S = 20.0  # Settings.alert_reopen_s, set by create_app


def upsert_alert(s: Session, job_id: Optional[int], agent_id: Optional[int], d: dict) -> Optional[Alert]:
    """One open alert per (job, kind): a repeat updates it, a clear closes it and says so."""
    now = time.time()
    current = s.scalar(select(Alert).where(Alert.job_id == job_id, Alert.kind == d["kind"],
                                           Alert.state != "cleared").order_by(Alert.id.desc()).limit(1))
    if d.get("clear"):
        if current is None:
            return None
        current.state, current.cleared_at, current.updated_at = "cleared", now, now
        current.message = f"{current.message}\nCleared: {d['message']}"
        return current
    if current is None and REOPEN_S > 0:
        current = s.scalar(select(Alert).where(Alert.job_id == job_id, Alert.kind == d["kind"],
                                               Alert.state == "cleared", Alert.cleared_at >= now - REOPEN_S)
                           .order_by(Alert.id.desc()).limit(1))
        if current is not None:  # cleared a moment ago: the same condition, back
            current.state, current.cleared_at = "open", None
    if current is not None:
        current.message, current.severity, current.updated_at = d["message"], d.get("severity", "warning"), now
        if d.get("stack"):
            current.stack = d["stack"]
        if d.get("data") is not None:
            current.data = json.dumps(d["data"])
        return current
    alert = Alert(job_id=job_id, agent_id=agent_id, kind=d["kind"], severity=d.get("severity", "warning"),
                  state="open", message=d["message"], stack=d.get("stack"), created_at=now, updated_at=now,
                  data=json.dumps(d["data"]) if d.get("data") is not None else None)
    s.add(alert)
    s.flush()
    return alert


def alert_dict(a: Alert) -> dict:
    return {"id": a.id, "job_id": a.job_id, "agent_id": a.agent_id, "kind": a.kind, "severity": a.severity,
            "state": a.state, "message": a.message, "stack": a.stack, "created_at": a.created_at,
            "updated_at": a.updated_at, "cleared_at": a.cleared_at,
            "data": json.loads(a.data) if a.data else None}
