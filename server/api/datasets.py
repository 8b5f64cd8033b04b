"""Preflight dataset analysis. The numbers come from the worker's analysis code, run in a child
process so the server itself never imports torch or a tokenizer."""
from __future__ import annotations

import asyncio
import json
import sys
import tempfile

from fastapi import APIRouter, HTTPException, Query

from server.context import AppDep
from server.errors import unprocessable
from server.security import UserDep
from server.validate import check_spec_async
from tokenpulse.protocol import DatasetAnalysis, JobSpec

router = APIRouter(prefix="/api/datasets", tags=["datasets"])


async def run_worker_tool(module: str, spec: JobSpec, timeout: float, *args: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(spec.model_dump_json())
        f.flush()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, "--spec", f.name, *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            raise HTTPException(504, f"dataset analysis took longer than {timeout:.0f} s") from None
    try:
        result = json.loads(out.decode().strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise HTTPException(500, f"analysis failed: {err.decode()[-2000:]}") from None
    if "error" in result:
        raise unprocessable([{"field": result.get("field", "dataset"), "message": result["error"]}], result["error"])
    return result


@router.post("/analyze")
async def analyze(spec: JobSpec, tp: AppDep, _: UserDep,
                  measure: float = Query(0, ge=0, le=600, description="seconds to spend measuring, per "
                                         "candidate sequence length, the largest micro-batch that fits and its "
                                         "tokens/s (on the server's machine; 0: not measured)")) -> DatasetAnalysis:
    """Token length histogram and percentiles, the recommended max_seq_length, what it truncates,
    and the predicted padding waste and real tokens per step for max_length / dynamic / packing;
    `warnings` with their fixes; with `measure`, `memory`: the sequence length vs micro-batch table."""
    spec = await check_spec_async(spec, tp.settings)  # a SpecError is a 422 naming the field (server/errors.py)
    extra = ("--measure", str(measure)) if measure else ()
    return await run_worker_tool("worker.training.analyze", spec, tp.settings.analyze_timeout_s, *extra)
