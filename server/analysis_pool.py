"""Dataset analyses (the preflight child of a submit, POST /api/datasets/analyze) run in a small
bounded pool: each child costs hundreds of MB and a core for seconds, so at most `slots` run at
once and the rest wait their turn, and no one caller holds more than `per_user` places (running
or waiting): past that, `Busy` (the analyze route answers 429 with Retry-After; a submit's
preflight skips its analysis, the job is queued all the same). `run_analyzer` starts the child
and reads its answer, for both.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
from collections import Counter
from typing import Hashable, Optional

from tokenpulse.protocol import JobSpec

RETRY_AFTER_S = 10
ANALYZER = "worker.training.analyze"


async def run_analyzer(spec: JobSpec, timeout: float, *args: str) -> tuple[Optional[dict], bytes]:
    """`python -m worker.training.analyze --spec SPEC *args` in a child, so the server itself never
    loads torch or a tokenizer: the JSON object of its last stdout line (None when it printed none)
    and its stderr. Past `timeout` the child is killed and waited for (a pool slot is free only once
    it is gone), then asyncio.TimeoutError is raised."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(spec.model_dump_json())
        f.flush()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", ANALYZER, "--spec", f.name, *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise
    try:
        return json.loads(out.decode().strip().splitlines()[-1]), err
    except (IndexError, ValueError):
        return None, err


class Busy(Exception):
    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S):
        super().__init__(message)
        self.message, self.retry_after = message, retry_after


class AnalysisPool:
    def __init__(self, slots: int = 2, per_user: int = 2, max_waiting: int = 32):
        self.slots, self.per_user, self.max_waiting = slots, per_user, max_waiting
        self._sem: Optional[asyncio.Semaphore] = None  # made on the server's loop, at first use
        self.held: Counter = Counter()  # caller -> places held (running or waiting)
        self.running = 0
        self.peak = 0  # most analyses ever run at once (tests, /metrics-free introspection)

    def waiting(self) -> int:
        return sum(self.held.values()) - self.running

    @contextlib.asynccontextmanager
    async def place(self, who: Hashable):
        """Hold a place for `who` and wait for a slot; Busy at once when `who` holds too many or the
        queue is full (nothing waits without bound)."""
        if self.held[who] >= self.per_user:
            raise Busy(f"you already have {self.held[who]} dataset analyses running or waiting (at most "
                       f"{self.per_user}); try again when one has finished")
        if self.waiting() >= self.max_waiting:
            raise Busy(f"{self.waiting()} dataset analyses are waiting already; try again shortly")
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.slots)
        self.held[who] += 1
        try:
            async with self._sem:
                self.running += 1
                self.peak = max(self.peak, self.running)
                try:
                    yield
                finally:
                    self.running -= 1
        finally:
            self.held[who] -= 1
            if self.held[who] <= 0:
                del self.held[who]


def pool_of(tp) -> AnalysisPool:
    """The app's pool (one per app: several apps in one test process must not share one)."""
    pool = getattr(tp, "_analysis_pool", None)
    if pool is None:
        s = tp.settings
        pool = tp._analysis_pool = AnalysisPool(getattr(s, "analysis_slots", 2), getattr(s, "analyses_per_user", 2))
    return pool
