"""Whether this agent's work dir can take a job, and a full disk named on every job it runs.

A problem (the journal could not be written, or under 1 MiB free) stops claims until a probe write
succeeds with space to spare: the journal rewriting an empty file is not space returning. While it
holds, each running job carries a disk_full alert, cleared when it is over."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from tokenpulse.protocol import AlertKind
from worker.agent.disk import low_space, probe_writable
from worker.agent.outbox import Outbox
from worker.agent.running import Emitter, RunningJob

log = logging.getLogger("tokenpulse.agent")


class DiskWatch:
    def __init__(self, work_dir: Path, agent_name: str, outbox: Outbox, jobs: dict[int, RunningJob], emit: Emitter):
        self.work_dir, self.agent_name, self.outbox, self.jobs, self.emit = work_dir, agent_name, outbox, jobs, emit
        self.error: Optional[str] = None  # the work dir could not be written (a full disk)
        self.alert: Optional[str] = None  # the disk problem the jobs' alerts name
        self.probe_at = 0.0  # monotonic time of the next probe while the disk is full

    def blocked(self) -> bool:
        """No claims while this agent's work dir is full or cannot be written: a job would fail for
        want of space, and a command job with a cwd of its own would run without its journal."""
        return self.check() is not None

    def check(self) -> Optional[str]:
        """Why the work dir cannot take a job now, or None. A problem holds until a probe write
        succeeds with space to spare: the journal rewriting an empty file is not space returning."""
        if self.error is None:
            self.error = self.outbox.disk_error or low_space(self.work_dir)
            if self.error is not None:
                log.error("%s: no claims until space returns", self.error)
        elif time.monotonic() >= self.probe_at:
            self.probe_at = time.monotonic() + 1.0  # a 64 KiB write and fsync, at most each second
            if self.outbox.disk_error is None and low_space(self.work_dir) is None and probe_writable(self.work_dir):
                log.warning("work dir %s is writable again: claiming jobs", self.work_dir)
                self.error = None
        return self.error

    def watch(self) -> None:
        """Name a full disk on every job this agent runs (an alert), and say when it is over."""
        problem = self.check()
        if problem and self.alert is None:
            self.alert = problem
            for rj in self.jobs.values():
                self.emit(rj, "alert", {"kind": AlertKind.DISK_FULL, "severity": "critical", "message": (
                    f"agent {self.agent_name}: {problem}; its events are kept in memory and still sent, "
                    "and it claims no new job until space returns")})
        elif not problem and self.alert is not None:
            self.alert = None
            for rj in self.jobs.values():
                self.emit(rj, "alert", {"kind": AlertKind.DISK_FULL, "clear": True,
                                        "message": f"agent {self.agent_name}: its disk is writable again"})
