"""A distributed job's rank table: GET /api/jobs/{id}/ranks."""
from __future__ import annotations

from fastapi import APIRouter, HTTPException

from server import ranks
from server.deps import AppDep, UserDep
from server.models import Job

router = APIRouter(prefix="/api/jobs", tags=["jobs"])


@router.get("/{job_id}/ranks")
def job_ranks(job_id: int, tp: AppDep, _: UserDep) -> list[dict]:
    """Each rank of the job's newest attempt: host, pid, device, step, step time (wall, and its own
    work with waits for the other ranks left out: busy_s), memory, last progress and its age, how it
    ended. Empty for a one-process job."""
    with tp.db.read() as s:
        if s.get(Job, job_id) is None:
            raise HTTPException(404, f"job {job_id} not found")
        return ranks.table(s, job_id)
