"""Submit-time preflight: the advice a submit answers with (`warnings`), each naming the field and
the fix. The job is created whatever it says.

Three sources, cheapest first:
- the spec alone (streaming with epochs), in-process;
- what an earlier job on the same model and data measured (its batch-size autotune table), read
  from the jobs table;
- the worker's own analysis of the data (`python -m worker.training.analyze` on a sample of
  PREFLIGHT_SAMPLE examples, in a child process: the server never loads torch or a tokenizer),
  only when the spec overrides something that analysis judges (a fixed max_seq_length, a lower
  length_coverage, padding=max_length or dynamic): the automatic choices need no advice. Its result
  is cached by the spec's relevant fields and the dataset file's identity (size, mtime, inode);
  the child reuses the tokenization cache in the data dir (keyed by the data's content hash).

Cost: the child starts Python, transformers and the tokenizer (~3 CPU-seconds) plus tokenizing the
sample, once per distinct (data, settings); a submit waits for it at most `preflight_wait_s`
(the answer then says the analysis is still running, and a later submit finds it cached). The
children run in the app's bounded pool (server/analysis_pool.py), shared with /api/datasets/analyze.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional

from sqlalchemy import select

from server.analysis_pool import AnalysisPool, Busy, run_analyzer
from server.models import Job
from tokenpulse.preflight import batch_size_warnings, spec_warnings
from tokenpulse.protocol import BUILTIN_DATASET, BUILTIN_MODEL, JobSpec

PREFLIGHT_SAMPLE = 2000  # examples the submit-time analysis tokenizes
CACHE_SIZE = 256
RELEVANT = ("model", "dataset", "text_field", "prompt_field", "response_field", "loss_on_response_only",
            "max_seq_length", "length_coverage", "padding", "group_by_length", "tokens_per_batch", "streaming",
            "epochs", "max_steps")

_cache: "OrderedDict[str, dict]" = OrderedDict()
_running: dict[str, asyncio.Task] = {}


def needs_analysis(spec: JobSpec) -> bool:
    """Only overrides can go wrong in ways the lengths show; the automatic choices are made from them."""
    return (spec.max_seq_length != "auto" or spec.padding in ("max_length", "dynamic")
            or spec.length_coverage < 99.0)


def file_identity(path: str) -> str:
    if path in (BUILTIN_DATASET, BUILTIN_MODEL):
        return path
    try:
        st = os.stat(path)
    except OSError:
        return f"{path}:missing"
    return f"{path}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def cache_key(spec: JobSpec) -> str:
    d = spec.model_dump(mode="json", include=set(RELEVANT))
    d["_data"] = file_identity(spec.dataset)
    d["_model"] = file_identity(str(Path(spec.model) / "config.json")) if spec.model != BUILTIN_MODEL else spec.model
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


async def run_analysis(spec: JobSpec, settings, timeout: float) -> dict:
    try:
        result, _ = await run_analyzer(spec, timeout, "--sample", str(PREFLIGHT_SAMPLE),
                                       "--cache-dir", str(settings.data_dir / "preflight-cache"))
    except asyncio.TimeoutError:
        return {"error": f"the analysis took longer than {timeout:.0f} s"}
    return result if result is not None else {"error": "the analysis printed no result"}


async def analysis(spec: JobSpec, settings, pool: Optional[AnalysisPool] = None,
                   who=None, wait_s: Optional[float] = None) -> tuple[Optional[dict], str]:
    """(the analysis or None, how it went: cached | done | pending | failed | busy). The child runs
    in the app's bounded pool (server/analysis_pool.py): a caller over their share, or a full
    queue, gets no analysis this time (busy), never an unbounded pile of children."""
    key = cache_key(spec)
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key], "cached"
    task = _running.get(key)
    if task is None:
        pool = pool or AnalysisPool()

        async def go():
            try:
                try:
                    async with pool.place(who):
                        res = await run_analysis(spec, settings, settings.analyze_timeout_s)
                except Busy as e:
                    return {"error": e.message, "busy": True}  # not cached: a later submit tries again
                _cache[key] = res
                while len(_cache) > CACHE_SIZE:
                    _cache.popitem(last=False)
                return res
            finally:
                _running.pop(key, None)
        task = _running[key] = asyncio.create_task(go())
    try:
        # shield: a submit that stops waiting leaves the analysis running, for the next submit
        res = await asyncio.wait_for(asyncio.shield(task), settings.preflight_wait_s if wait_s is None else wait_s)
    except asyncio.TimeoutError:
        return None, "pending"
    return res, "busy" if res.get("busy") else "failed" if "error" in res else "done"


def measured_before(s, spec: JobSpec) -> Optional[tuple[int, dict]]:
    """The newest job on the same model and data whose batch-size autotune left its table."""
    for job_id, spec_json, info_json in s.execute(
            select(Job.id, Job.spec, Job.info).where(Job.info.contains('"measured"'))
            .order_by(Job.id.desc()).limit(200)):
        other = json.loads(spec_json)
        if other.get("model") == spec.model and other.get("dataset") == spec.dataset:
            info = json.loads(info_json)
            if isinstance(info.get("batch_size"), int):
                return job_id, info
    return None


async def preflight(spec: JobSpec, settings, db, pool: Optional[AnalysisPool] = None, who=None,
                    wait_s: Optional[float] = None) -> dict:
    """{"warnings": [...], "preflight": {"analysis": ..., "seconds": ...}} for a validated spec.
    wait_s: how long to wait for the data analysis (default: the submit's preflight_wait_s); the job
    page's and the form's later ask (GET /api/jobs/{id}/preflight) waits longer for a pending one."""
    t0 = time.monotonic()
    warnings = spec_warnings(spec)
    state = "not needed"
    if isinstance(spec.batch_size, int):
        def look():
            with db.read() as s:
                return measured_before(s, spec)
        seen = await asyncio.to_thread(look)
        if seen is not None:
            warnings += batch_size_warnings(spec, seen[1], seen[0])
    if needs_analysis(spec) and (settings.preflight_wait_s > 0 or wait_s):
        res, state = await analysis(spec, settings, pool, who, wait_s)
        if res is not None and "error" not in res:
            # the analysis's own rules (tokenpulse.preflight.analysis_warnings), minus the spec's we have
            warnings += [w for w in res.get("warnings", []) if w["kind"] != "streaming_epochs"]
    return {"warnings": warnings, "preflight": {"analysis": state, "seconds": round(time.monotonic() - t0, 3)}}
