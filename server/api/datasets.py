"""Preflight dataset analysis. The numbers come from the worker's analysis code, run in a child
process so the server itself never imports torch or a tokenizer."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, HTTPException, Query

from server.analysis_pool import Busy, pool_of, run_analyzer
from server.context import AppDep
from server.errors import unprocessable
from server.security import UserDep
from server.validate import check_spec_async, quotable
from tokenpulse.protocol import DatasetAnalysis, JobSpec

router = APIRouter(prefix="/api/datasets", tags=["datasets"])


async def analyze_in_child(spec: JobSpec, timeout: float, *args: str, quote: bool = True) -> dict:
    """The worker's analyzer in a child (analysis_pool.run_analyzer); its answer, or its error as a
    422. quote=False: the dataset may not be quoted (outside the path roots, validate.quotable), so
    neither its error nor its stderr (which may carry the data's columns or a line of it) reaches the caller."""
    try:
        result, err = await run_analyzer(spec, timeout, *args)
    except asyncio.TimeoutError:
        raise HTTPException(504, f"dataset analysis took longer than {timeout:.0f} s") from None
    if result is None:
        raise HTTPException(500, f"analysis failed: {err.decode()[-2000:]}" if quote else
                            "analysis failed (its output is shown only for data under the server's path roots)")
    if "error" in result:
        message = result["error"] if quote else (
            "the analysis of this dataset failed; its message is shown only for files under the server's path "
            "roots (TOKENPULSE_PATH_ROOTS), as it may quote the file")
        raise unprocessable([{"field": result.get("field") or "dataset", "message": message}], message)
    return result


@router.post("/analyze")
async def analyze(spec: JobSpec, tp: AppDep, caller: UserDep,
                  measure: float = Query(0, ge=0, le=600, description="seconds to spend measuring, per "
                                         "candidate sequence length, the largest micro-batch that fits and its "
                                         "tokens/s (on the server's machine; 0: not measured)")) -> DatasetAnalysis:
    """Token length histogram and percentiles, the recommended max_seq_length, what it truncates,
    and the predicted padding waste and real tokens per step for max_length / dynamic / packing;
    `warnings` with their fixes; with `measure`, `memory`: the sequence length vs micro-batch table.
    Analyses run a few at a time (the rest wait); a caller with too many running or waiting gets
    429 with Retry-After."""
    spec = await check_spec_async(spec, tp.settings)  # a SpecError is a 422 naming the field (server/errors.py)
    extra = ("--measure", str(measure)) if measure else ()
    try:
        async with pool_of(tp).place(caller.principal_id):  # at most a few children at once, queued
            return await analyze_in_child(spec, tp.settings.analyze_timeout_s, *extra,
                                          quote=quotable(tp.settings, spec.dataset))
    except Busy as e:
        raise HTTPException(429, e.message, headers={"Retry-After": str(e.retry_after)}) from None
