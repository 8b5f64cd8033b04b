"""Alert rules (server/rules.py evaluates them beside ingest): list, add, remove. A rule belongs to the
person whose token made it; a user sees and removes its own, an admin all. A rule watches its owner's
jobs only (an admin's: every job); its count, its channels' count and their destinations are
limited (Settings.rules_per_user, channels_per_rule, webhook_allow)."""
from __future__ import annotations

import json
import time
from typing import Literal, Optional

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select

from server.context import AppDep
from server.destinations import Policy, Refused
from server.errors import unprocessable
from server.ingest.alerts import alert_dict, upsert_alert
from server.models import Alert, AlertRule, Job
from server.rules import CONDITIONS, KIND_PREFIX, RULES, STATES, Rule
from server.security import UserDep, not_yours
from tokenpulse.protocol import ALERTS_TOPIC, alert_frame

router = APIRouter(prefix="/api/rules", tags=["rules"])


class Channel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(min_length=8, max_length=2000, pattern=r"^https?://\S+$",
                     description="a webhook URL (Slack or Discord incoming webhook, or any JSON receiver)")
    format: Literal["slack", "discord", "json"] = Field(
        "slack", description='the body: slack {"text"}, discord {"content"}, json: the whole alert with "text"')


class NewRule(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field(min_length=1, max_length=200)
    scope: Literal["all", "name", "job"] = Field("all", description="every job, jobs whose name matches "
                                                                    "`pattern`, or the job `job_id`")
    pattern: Optional[str] = Field(None, min_length=1, max_length=200, description="a name glob: sft-*")
    job_id: Optional[int] = Field(None, ge=1, le=2**62)
    condition: Literal[CONDITIONS]  # type: ignore[valid-type]
    metric: Optional[str] = Field(None, min_length=1, max_length=64, description="a logged metric: eval/loss")
    threshold: Optional[float] = Field(None, description="above / below: the value")
    steps: Optional[int] = Field(None, ge=1, le=10**9, description="no_improvement: steps without a new best")
    mode: Literal["min", "max"] = Field("min", description="no_improvement: lower (min) or higher (max) is better")
    sigmas: Optional[float] = Field(None, gt=0, le=1000, description="jump: standard deviations from the recent mean")
    state: Optional[Literal[STATES]] = Field(None,
                                             description="state: the job state that fires")  # type: ignore[valid-type]
    severity: Literal["info", "warning", "critical"] = "warning"
    channels: list[Channel] = Field(default_factory=list, max_length=1000,
                                    description="at most Settings.channels_per_rule (10 by default)")


NEEDS = {"above": ("metric", "threshold"), "below": ("metric", "threshold"), "no_improvement": ("metric", "steps"),
         "jump": ("metric", "sigmas"), "nonfinite": ("metric",), "state": ("state",)}


def check(body: NewRule, settings, policy: Policy) -> None:
    """The fields a scope and a condition need, each named when missing; the channels' number and
    destinations (server/destinations.py: no internal address unless an admin allowed it)."""
    errors = []
    if len(body.channels) > settings.channels_per_rule:
        errors.append({"field": "channels", "message": f"at most {settings.channels_per_rule} channels per rule "
                       "(limit channels_per_rule: an admin raises it with TOKENPULSE_CHANNELS_PER_RULE)"})
    for i, ch in enumerate(body.channels):
        try:
            policy.check_url(ch.url)
        except Refused as e:
            errors.append({"field": f"channels.{i}.url", "message": str(e)})
    if body.scope == "name" and not body.pattern:
        errors.append({"field": "pattern", "message": "is required for scope 'name' (a job-name glob such as sft-*)"})
    if body.scope == "job" and body.job_id is None:
        errors.append({"field": "job_id", "message": "is required for scope 'job'"})
    for f in NEEDS[body.condition]:
        if getattr(body, f) is None:
            errors.append({"field": f, "message": f"is required for condition '{body.condition}'"})
    if body.condition == "state" and body.metric is not None:
        errors.append({"field": "metric", "message": "a state rule watches the job's state, not a metric"})
    if errors:
        raise unprocessable(errors)


def visible(caller, rule: AlertRule) -> bool:
    return caller.is_admin or rule.owner_token_id == caller.principal_id


@router.get("")
def list_rules(tp: AppDep, caller: UserDep) -> list[dict]:
    """Your rules (an admin: everyone's)."""
    with tp.db.read() as s:
        return [Rule.of(r).out() for r in s.scalars(select(AlertRule).order_by(AlertRule.id)) if visible(caller, r)]


@router.post("", status_code=201)
async def add_rule(body: NewRule, tp: AppDep, caller: UserDep) -> dict:
    """A rule acts on its owner's jobs only; an admin's rule of scope `all` on every job."""
    settings = tp.settings
    check(body, settings, tp.webhooks.policy if tp.webhooks is not None else Policy(settings.webhook_allow))

    def add(s):
        if body.scope == "job":
            job = s.get(Job, body.job_id)
            if job is None:
                raise unprocessable([{"field": "job_id", "message": f"job {body.job_id} does not exist"}])
            if not caller.owns(job.owner_token_id):
                raise not_yours("watch with a rule", f"job {job.id}", job.owner_token_id)
        mine = s.scalar(select(func.count()).select_from(AlertRule)
                        .where(AlertRule.owner_token_id == caller.principal_id))
        if mine >= settings.rules_per_user:
            raise HTTPException(409, f"you have {mine} rules, the limit (rules_per_user: an admin raises it "
                                     f"with TOKENPULSE_RULES_PER_USER); remove one first")
        r = AlertRule(name=body.name, owner_token_id=caller.principal_id, scope=body.scope,
                      pattern=body.pattern if body.scope == "name" else None,
                      job_id=body.job_id if body.scope == "job" else None, condition=body.condition,
                      metric=body.metric, threshold=body.threshold, steps=body.steps, sigmas=body.sigmas,
                      mode=body.mode if body.condition == "no_improvement" else None, state=body.state,
                      severity=body.severity, channels=json.dumps([c.model_dump() for c in body.channels]),
                      created_at=time.time())
        s.add(r)
        s.flush()
        return Rule.of(r).out()
    out = await tp.db.write(add)
    RULES.changed()
    return out


@router.delete("/{rule_id}")
async def remove_rule(rule_id: int, tp: AppDep, caller: UserDep) -> dict:
    """Remove a rule; its open alerts clear."""
    def remove(s):
        r = s.get(AlertRule, rule_id)
        if r is None or not visible(caller, r):
            raise HTTPException(404, f"rule {rule_id} does not exist" + ("" if r is None else " among your rules"))
        cleared = []
        for a in s.scalars(select(Alert).where(Alert.kind == f"{KIND_PREFIX}{rule_id}", Alert.state != "cleared")):
            c = upsert_alert(s, a.job_id, a.agent_id,
                             {"kind": a.kind, "clear": True, "message": "its rule was removed"})
            if c is not None:
                cleared.append(alert_dict(c))
        s.delete(r)
        return cleared
    cleared = await tp.db.write(remove)
    RULES.changed()
    for d in cleared:
        tp.hub.publish(ALERTS_TOPIC, alert_frame(d), False)
    return {"removed": rule_id, "cleared_alerts": len(cleared)}
