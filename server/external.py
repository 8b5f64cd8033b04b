"""External jobs: a script started by hand (not by an agent) that reports through the explicit API.

It is a job like any other (events, metrics, alerts, the same pages), with no agent: created
`starting` by the script's own watchdog process (tokenpulse/watchdog.py) with a person's token, which
then sends event batches for it, with the job's own credential (returned once by the create call;
only it or an admin may post the job's events), exactly as an agent does (per-job seq numbers, acknowledged, replays ignored). No
schema of its own: kind "external", the job's info carries {"external": {...}}, and its spec only
its name (never run by any agent). It is never queued, so no agent can claim it; pause, resume and
clone are refused (there is nothing tokenpulse could restart), cancel reaches the watchdog in the
reply to its next batch and the watchdog stops the script.
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy.orm import Session

from server import store
from server.auth import hash_token
from server.models import Attempt, Job
from tokenpulse.protocol import ACTIVE_STATES, EXTERNAL, Command, JobSpec, JobState

MAX_CONFIG_BYTES = 64 * 1024


class ExternalRun(BaseModel):
    """What a script started by hand says about itself when it creates its job."""
    model_config = ConfigDict(extra="forbid")
    name: Optional[str] = Field(None, max_length=200, description="a label for the run")
    config: dict[str, Any] = Field(default_factory=dict, description="the run's settings, shown on its page")
    command: Optional[str] = Field(None, max_length=8192, description="the command line that started it")
    host: Optional[str] = Field(None, max_length=200)
    pid: Optional[int] = Field(None, ge=1, le=2 ** 31)
    cwd: Optional[str] = Field(None, max_length=4096)

    @field_validator("config")
    @classmethod
    def _small(cls, v: dict) -> dict:
        try:
            size = len(json.dumps(v, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ValueError(f"must be plain JSON (finite numbers): {e}")
        if size > MAX_CONFIG_BYTES:
            raise ValueError(f"at most {MAX_CONFIG_BYTES} bytes as JSON")
        return v


def is_external(job: Job) -> bool:
    return job.kind == EXTERNAL


REPORT_PREFIX = "tpr_"


def new_report_token() -> str:
    """An external job's own credential: it may post that job's events and nothing else."""
    return REPORT_PREFIX + secrets.token_urlsafe(24)


def create(s: Session, run: ExternalRun, owner: Optional[int], report_token: str) -> Job:
    job = store.create_job(s, JobSpec(name=run.name, max_retries=0), owner=owner)
    job.report_hash = hash_token(report_token)
    # Only what is true of it (a full JobSpec would show a model and dataset it never used); still a
    # valid JobSpec for code that reads any job's spec.
    job.spec = json.dumps({"name": run.name, "max_retries": 0} if run.name else {"max_retries": 0})
    job.kind = EXTERNAL
    now = time.time()
    job.state, job.attempt, job.alive_at, job.total_steps = JobState.starting.value, 1, now, None
    job.info = json.dumps({"external": run.model_dump(exclude={"config"}, exclude_none=True),
                           "config": run.config})
    s.add(Attempt(job_id=job.id, attempt=1, agent_id=None, started_at=now))
    return job


def split_alive(events: list) -> tuple[list, Optional[float]]:
    """Alive events are liveness, not history: they set the job's alive time (as an agent's
    heartbeat does) and are not stored."""
    alive_at, rest = None, []
    for e in events:
        if e.kind == "alive":
            alive_at = e.t if alive_at is None else max(alive_at, e.t)
        else:
            rest.append(e)
    return rest, alive_at


def commands_for(job: Job) -> list[Command]:
    """Cancel and stack requests for the watchdog (stack is one-shot, as for agents)."""
    if JobState(job.state) not in ACTIVE_STATES:
        return []
    out = []
    if job.requested_action == "cancel":
        out.append(Command(job_id=job.id, action="cancel"))
    if job.stack_requested_at is not None:
        job.stack_requested_at = None
        out.append(Command(job_id=job.id, action="stack"))
    return out
