"""A job this agent runs, as its rooms share it: the job run (job_run.py), its diagnosis
(job_diagnosis.py), the exit verdict (exits.py) and the server link (link.py) all read one
RunningJob; events leave through one Emitter."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Optional

from tokenpulse.diagnosis.stall import StallDetector
from tokenpulse.protocol import Claim, CommandSpec
from worker.agent import gangwatch, sysmetrics
from worker.agent.advice import Advisor
from worker.agent.child import Supervised
from worker.agent.outbox import Outbox
from worker.agent.output import Masker
from worker.agent.printed_metrics import JobMetrics
from worker.agent.slow import SlowDetector

log = logging.getLogger("tokenpulse.agent")


class Requested(str, Enum):
    """What was asked of a running job, at most one course at a time: a person's cancel or pause,
    this agent's own shutdown, or a pause the job cannot honour (a command that never said it can
    checkpoint: it keeps running, and a later cancel still wins)."""
    CANCEL = "cancel"
    PAUSE = "pause"
    SHUTDOWN = "shutdown"
    PAUSE_REFUSED = "pause-refused"
    HANG = "hang"  # stalled past stall.kill_after_s: killed, to end as a hang (job_diagnosis.py)


@dataclass
class RunningJob:
    claim: Claim
    process: Supervised
    detector: StallDetector
    slow: Optional[SlowDetector] = None
    advice: Optional[Advisor] = None  # a command job's first-steps verdicts, each with its fix
    alive_at: float = field(default_factory=time.time)
    child_state: Optional[dict] = None
    requested: Optional[Requested] = None  # cancel or pause, once asked
    started: float = field(default_factory=time.monotonic)  # when the attempt began (agent clock)
    born: float = field(default_factory=time.time)  # alive_at moves past this at the child's first event
    stack_lines: Optional[list] = None  # collecting a faulthandler dump
    tasks: list = field(default_factory=list)
    gang: Optional[gangwatch.GangState] = None  # a distributed job: its ranks (torchrun)
    mask: Masker = field(default_factory=lambda: Masker(()))  # secret values -> *** in output
    stderr_tail: deque = field(default_factory=lambda: deque(maxlen=400))  # for the traceback
    cwd: Optional[Path] = None  # a command job's working directory
    pausable: bool = False  # its events said it can checkpoint and pause on SIGUSR2
    stall_clear: Optional[tuple] = None  # (since, message): moving again, the stall alert's clear held
    sys: Optional[sysmetrics.TreeSampler] = None  # its process tree's CPU, memory, disk, GPU (sys/ series)
    asked_at: Optional[float] = None  # when this agent asked it for a checkpoint (SIGUSR2: pause, stop)
    # its stall, once alerted: {"since", "step", "frame", "headline"} (ended as a hang after kill_after_s)
    hang: Optional[dict] = None
    kill_after_s: float = 0.0  # 0: a stall is never killed
    # a command job's printed loss and where each of its metrics came from (printed_metrics.py)
    sourced: Optional[JobMetrics] = None
    # the server gave this job out again (to this agent) while this attempt ran: its events are dropped
    superseded: bool = False

    @property
    def command(self) -> Optional[CommandSpec]:
        return self.claim.spec if isinstance(self.claim.spec, CommandSpec) else None


class Emitter:
    """The one way a job's events leave this agent: into the outbox (journaled, numbered, resent until
    acknowledged); a state, an alert or a phase flushed at once."""

    def __init__(self, outbox: Outbox, flush_now: asyncio.Event):
        self.outbox, self.flush_now = outbox, flush_now

    def __call__(self, rj: RunningJob, kind: str, data: dict, t: Optional[float] = None) -> None:
        if rj.superseded:  # an attempt the server ended: stored now, its events would be the next one's
            return
        if rj.claim.node_rank:  # a multi-node job's other nodes: node rank 0's agent tells the story
            if kind in ("state", "alert") or kind == "log" and data.get("stream") == "agent":
                log.info("job %s (node %s): %s %s", rj.claim.job_id, rj.claim.node_rank, kind, str(data)[:500])
            return
        self.outbox.add(rj.claim.job_id, kind, data, t)
        if kind in ("state", "alert", "phase"):
            self.flush_now.set()
