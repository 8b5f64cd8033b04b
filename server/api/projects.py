"""Projects: every job's group (jobs.project), with how many jobs and sweeps each holds."""
from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import func, select

from server.context import AppDep
from server.models import Job, Sweep
from server.security import UserDep
from tokenpulse.protocol import ACTIVE_STATES, DEFAULT_PROJECT

router = APIRouter(prefix="/api/projects", tags=["projects"])


@router.get("")
def list_projects(tp: AppDep, _: UserDep) -> list[dict]:
    """Every project with jobs or sweeps in it (and the default one): jobs, active jobs, sweeps."""
    active = [x.value for x in ACTIVE_STATES]
    with tp.db.read() as s:
        jobs = dict(s.execute(select(Job.project, func.count()).group_by(Job.project)).all())
        running = dict(s.execute(select(Job.project, func.count()).where(Job.state.in_(active))
                                 .group_by(Job.project)).all())
        sweeps = dict(s.execute(select(Sweep.project, func.count()).group_by(Sweep.project)).all())
    names = sorted(set(jobs) | set(sweeps) | {DEFAULT_PROJECT})
    return [{"project": p, "jobs": jobs.get(p, 0), "active": running.get(p, 0), "sweeps": sweeps.get(p, 0)}
            for p in names]
