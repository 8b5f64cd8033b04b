"""A queued job's preflight advice, asked again after its submit: a submit waits for the data analysis
only `preflight_wait_s`, and its answer then says "pending". The submit form (and a script) ask here,
waiting longer, so the warnings are shown when they exist rather than minutes later as an alert."""
from __future__ import annotations

import json

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel

from server.analysis_pool import pool_of
from server.api.jobs import get_job_or_404
from server.context import AppDep
from server.preflight import preflight
from server.schemas import PreflightOut, PreflightWarning
from server.security import UserDep
from tokenpulse.protocol import TRAIN, JobSpec

router = APIRouter(prefix="/api/jobs", tags=["jobs"])


class PreflightAnswer(BaseModel):
    warnings: list[PreflightWarning]
    preflight: PreflightOut


@router.get("/{job_id}/preflight")
async def job_preflight(job_id: int, tp: AppDep, caller: UserDep,
                        wait_s: float = Query(30, ge=0, le=300, description="seconds to wait for a pending data "
                                              "analysis")) -> PreflightAnswer:
    """The submit's warnings for this job, waiting up to wait_s for the data analysis ("pending" again
    when it takes longer still). A command job has none."""
    with tp.db.read() as s:
        job = get_job_or_404(s, job_id)
        kind, spec = job.kind, json.loads(job.spec)
    if kind != TRAIN:
        raise HTTPException(409, f"job {job_id} is a {kind} job: preflight advice is for training jobs")
    return await preflight(JobSpec.model_validate(spec), tp.settings, tp.db, pool_of(tp), caller.principal_id, wait_s)
