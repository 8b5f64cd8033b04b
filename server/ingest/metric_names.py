"""How many distinct metric names one job may log (issue 34): a run that logs a hundred thousand
names would make its own rows, every read of them and every jobs list that carries its latest values
(Job.last) grow without bound. Past the limit the job gets ONE warning alert naming the limit and how
to raise it, and points of further names are refused (not stored); the names it had keep going.

`limit()` is this server's number; its default, tokenpulse/limits.py's METRIC_NAMES_PER_JOB, is the
one a training process's metric capture can read without the server's code. Settings.metric_names_per_job
sets it (TOKENPULSE_METRIC_NAMES_PER_JOB).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from sqlalchemy import text
from sqlalchemy.orm import Session

from tokenpulse.limits import METRIC_NAMES_PER_JOB

LIMIT = METRIC_NAMES_PER_JOB  # set from Settings by create_app
ALERT_KIND = "metric_names_limit"
TRACKED_JOBS = 10_000  # jobs whose names are kept in memory (least recently logged dropped first)


def limit() -> int:
    """Distinct metric names one job may log on this server."""
    return LIMIT


def warning(job_id: int) -> dict:
    """The alert a job gets when it passes the limit (upsert_alert's dict)."""
    return {"kind": ALERT_KIND, "severity": "warning",
            "message": f"job {job_id} logged more than {LIMIT} distinct metric names (limit metric_names_per_job); "
                       "points of further names are not stored. An admin raises it with "
                       "TOKENPULSE_METRIC_NAMES_PER_JOB."}


class JobMetricNames:
    """Each recently logging job's metric names, read once from its stored series after a start."""

    def __init__(self):
        self.by_job: OrderedDict[int, set] = OrderedDict()
        self.warned: set[int] = set()

    def admit(self, s: Session, job_id: int, values: dict) -> tuple[dict, bool]:
        """The values whose names the job may log (the same dict when all are known), and whether
        any was refused. Hot: one set comparison per metrics event in the common case."""
        names = self.by_job.get(job_id)
        if names is None:
            names = self._load(s, job_id)
        if names.issuperset(values):
            return values, False
        admitted, refused = {}, False
        for k, v in values.items():
            if k in names:
                admitted[k] = v
            elif len(names) < LIMIT:
                names.add(k)
                admitted[k] = v
            else:
                refused = True
        return admitted, refused

    def first_refusal(self, job_id: int) -> Optional[dict]:
        """The warning to raise, once per job and process (a repeat would only update it)."""
        if job_id in self.warned:
            return None
        self.warned.add(job_id)
        return warning(job_id)

    def _load(self, s: Session, job_id: int) -> set:
        names = {n for (n,) in s.execute(text(
            "SELECT k.name FROM metric_keys k WHERE k.id IN "
            "(SELECT DISTINCT key_id FROM metric_rollups WHERE job_id = :j)"), {"j": job_id})}
        self.by_job[job_id] = names
        while len(self.by_job) > TRACKED_JOBS:
            self.by_job.popitem(last=False)
        return names


NAMES = JobMetricNames()
