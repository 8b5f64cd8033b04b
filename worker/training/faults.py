"""Test-only fault injection, kept out of the public JobSpec.

A test or benchmark sets TOKENPULSE_FAULT_PLAN in the environment of the agent (or `tokenpulse up`)
it starts; the agent passes its environment on to the training process. The variable names a JSON
file mapping a job's name to the faults that job gets, e.g.

    {"hangs": {"hang_at_step": 8}, "slow": {"step_sleep_s": 0.2}, "*": {...}}

("*" applies to every job not named). The file is read when a training process starts, so a test may
write it after the agent is up; a file that does not exist (yet) is an empty plan. Training code calls
`Faults.at(point, ...)`, the one hook.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from tokenpulse.protocol import Phase

from .errors import EXIT_FAULT_CRASH, Cancelled

PLAN_ENV = "TOKENPULSE_FAULT_PLAN"
Point = Literal["data", "step", "loss", "step_end", "collate"]


class Fault(BaseModel):
    """What one job gets; every field optional."""
    model_config = ConfigDict(extra="forbid")  # a typo in a plan fails loudly, not silently healthy
    hang_at_step: Optional[int] = Field(None, ge=0, description="sleep forever at this step")
    slow_after_step: Optional[int] = Field(None, ge=0, description="steps get slow_factor x slower from here")
    slow_factor: float = Field(5.0, ge=1)
    slow_data_s: Optional[float] = Field(None, ge=0, description="data phase lasts this long, reporting progress")
    crash_at_step: Optional[int] = Field(None, ge=0, description=f"exit({EXIT_FAULT_CRASH}) at this step")
    nan_at_step: Optional[int] = Field(None, ge=0, description="loss becomes NaN at this step")
    step_sleep_s: float = Field(0.0, ge=0, description="sleep this long every step (a slow but alive job)")
    bad_row_at_step: Optional[int] = Field(None, ge=0, description="collating this step's batch raises a data "
                                           "error naming its row")
    rank: Optional[int] = Field(None, ge=0, description="only this rank of a distributed job gets the fault")


def plan_for(job_name: Optional[str], environ=os.environ) -> Optional[Fault]:
    """The fault planned for this job, or None (no plan, or the job is not in it)."""
    path = environ.get(PLAN_ENV)
    if not path or not Path(path).exists():  # tests name the file up front and write it on first use
        return None
    plan = json.loads(Path(path).read_text())
    entry = plan.get(job_name or "", plan.get("*"))
    if entry is None:
        return None
    fault = Fault.model_validate(entry)
    if fault.rank is not None and fault.rank != int(environ.get("RANK", "0") or 0):
        return None  # a per-rank fault, for another rank
    return fault


def _fault_hang() -> None:
    """hang_at_step: never returns (the name is what the stall detector's stack capture shows)."""
    while True:
        time.sleep(3600)


class Faults:
    """A job's faults; with none, every hook is a no-op."""

    def __init__(self, fault: Optional[Fault] = None):
        self.fault = fault

    @classmethod
    def for_job(cls, job_name: Optional[str]) -> "Faults":
        return cls(plan_for(job_name))

    def at(self, point: Point, step: int = 0, seconds: float = 0.0, em=None,
           should_stop: Callable[[], bool] = lambda: False) -> bool:
        """The hook. "data": start of the data phase; "step": before a step; "loss": True poisons
        this step's loss; "step_end": after a step that took `seconds`."""
        f = self.fault
        if f is None:
            return False
        if point == "data" and f.slow_data_s:
            _slow_data(f.slow_data_s, em, should_stop)
        elif point == "step":
            if f.crash_at_step is not None and step == f.crash_at_step:
                sys.stderr.write(f"fault injection: crash at step {step}\n")
                sys.stderr.flush()
                os._exit(EXIT_FAULT_CRASH)
            if f.hang_at_step is not None and step == f.hang_at_step:
                _fault_hang()
            if f.step_sleep_s:
                time.sleep(f.step_sleep_s)
        elif point == "collate" and f.bad_row_at_step is not None and step == f.bad_row_at_step:
            raise ValueError(f"fault injection: cannot collate row {1000 + step} of the dataset: column 'text' "
                             "holds None, not a string")
        elif point == "loss":
            return f.nan_at_step is not None and step == f.nan_at_step
        elif point == "step_end" and f.slow_after_step is not None and step >= f.slow_after_step:
            time.sleep(seconds * (f.slow_factor - 1))
        return False


def _slow_data(seconds: float, em, should_stop: Callable[[], bool]) -> None:
    """A data phase that takes `seconds`, visibly alive (progress every 0.5 s)."""
    t0 = time.monotonic()
    while (el := time.monotonic() - t0) < seconds:
        em.phase(Phase.LOADING_DATASET, done=round(el, 1), total=seconds, unit="s", detail="slow_data_s fault")
        if should_stop():
            raise Cancelled()
        time.sleep(min(0.5, seconds - el))
