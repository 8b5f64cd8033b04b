"""A distributed job's rank table: GET /api/jobs/{id}/ranks."""
from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from server import ranks
from server.context import AppDep
from server.models import Job
from server.security import UserDep

router = APIRouter(prefix="/api/jobs", tags=["jobs"])


class RankOut(BaseModel):
    rank: int
    attempt: int = Field(description="the attempt these ranks ran in")
    agent_id: Optional[int] = None
    host: Optional[str] = None
    pid: Optional[int] = None
    device: Optional[str] = None
    step: Optional[int] = Field(None, description="optimizer steps it finished")
    step_time_s: Optional[float] = Field(None, description="its last step, wall clock")
    busy_s: Optional[float] = Field(None, description="its own work in that step, waits for the other ranks left out")
    rss_mb: Optional[float] = None
    alive_at: Optional[float] = None
    progress_at: Optional[float] = Field(None, description="when its step last moved (agent clock)")
    progress_age_s: Optional[float] = None
    exit: Optional[str] = None
    updated_at: float


@router.get("/{job_id}/ranks", response_model=list[RankOut])
def job_ranks(job_id: int, tp: AppDep, _: UserDep) -> list[dict]:
    """Each rank of the job's newest attempt: host, pid, device, step, step time (wall, and its own
    work with waits for the other ranks left out: busy_s), memory, last progress and its age, how it
    ended. Empty for a one-process job."""
    with tp.db.read() as s:
        if s.get(Job, job_id) is None:
            raise HTTPException(404, f"job {job_id} not found")
        return ranks.table(s, job_id)
