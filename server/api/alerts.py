"""Alerts: list with filters, acknowledge."""
from __future__ import annotations

import time
from typing import Literal, Optional

from fastapi import APIRouter, HTTPException, Query
from sqlalchemy import select

from server.context import AppDep
from server.ingest.alerts import alert_dict
from server.models import Alert, AlertRule, Job
from server.schemas import AlertOut
from server.security import UserDep
from tokenpulse.protocol import ALERTS_TOPIC, alert_frame

router = APIRouter(prefix="/api/alerts", tags=["alerts"])


@router.get("")
def list_alerts(tp: AppDep, _: UserDep, job_id: Optional[int] = None,
                state: Optional[Literal["open", "acked", "cleared"]] = None,
                kind: Optional[str] = Query(None, max_length=64),
                severity: Optional[Literal["info", "warning", "critical"]] = None,
                limit: int = Query(100, ge=1, le=10_000)) -> list[AlertOut]:
    with tp.db.read() as s:
        where = []
        if job_id is not None:
            where.append(Alert.job_id == job_id)
        if state is not None:
            where.append(Alert.state == state)
        if kind is not None:  # 'rule:' alone: every rule's alerts
            where.append(Alert.kind.startswith(kind) if kind.endswith(":") else Alert.kind == kind)
        if severity is not None:
            where.append(Alert.severity == severity)
        rows = [alert_dict(a) for a in s.scalars(select(Alert).where(*where).order_by(Alert.id.desc()).limit(limit))]
        # names beside the ids: "#4 sft-a", "rule: loss too high" read better than "#4", "rule:1"
        jobs = {r["job_id"] for r in rows if r["job_id"] is not None}
        names = dict(s.execute(select(Job.id, Job.name).where(Job.id.in_(jobs))).all()) if jobs else {}
        rules = {int(k[5:]) for k in {r["kind"] for r in rows} if k.startswith("rule:") and k[5:].isdigit()}
        rule_names = dict(s.execute(select(AlertRule.id, AlertRule.name).where(AlertRule.id.in_(rules))).all()) \
            if rules else {}
        for r in rows:
            r["job_name"] = names.get(r["job_id"])
            tail = r["kind"][5:]
            r["rule_name"] = rule_names.get(int(tail)) if r["kind"].startswith("rule:") and tail.isdigit() else None
        return rows


@router.post("/{alert_id}/ack")
async def ack_alert(alert_id: int, tp: AppDep, caller: UserDep) -> AlertOut:
    """Acknowledge (silence) an alert: its job's owner or an admin may; a server alert (no job), an admin."""
    def ack(s):
        a = s.get(Alert, alert_id)
        if a is None:
            raise HTTPException(404, f"alert {alert_id} does not exist")
        job = s.get(Job, a.job_id) if a.job_id is not None else None
        if not caller.is_admin and (job is None or not caller.owns(job.owner_token_id)):
            raise HTTPException(403, f"acknowledging alert {alert_id} refused: only "
                                     + (f"job {a.job_id}'s owner or an admin" if job is not None else "an admin")
                                     + " may silence it")
        if a.state == "open":
            a.state, a.updated_at = "acked", time.time()
        return alert_dict(a)
    d = await tp.db.write(ack)
    tp.hub.publish(ALERTS_TOPIC, alert_frame(d), False)
    return d
