"""The agent: claims jobs from the server, runs each in a supervised process, relays its events,
heartbeats, watches for stalls, and carries out commands (cancel, pause, stack).

It talks to the server only over HTTP (and its websocket), so it can run on any machine that reaches
the server. Its rooms, each handed what it needs from the others as callables:
  link.py           the server link: calls retried, registration, heartbeats, events sent until acked
  job_run.py        one job's run: start, read its events and output, supervise, commands, finish
  job_setup.py      before the start: resume checkpoint, a command's environment and directory
  warm.py           warm start: a standby forked from the agent's zygote (zygote.py) per job, handed it on claim
  job_diagnosis.py  stalled, slow, quiet, a gang's ranks: detectors fed, alerts raised
  exits.py          how an attempt ended: the ExitVerdict, the job's alerts closed
  sysloop.py        system metrics every few seconds; diskwatch.py: a full work dir
This file ties them: the claim loop and the stop.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Optional

from tokenpulse.diagnosis.stall import StallConfig
from tokenpulse.protocol import AgentHello, Claim
from worker.agent import tree
from worker.agent.diskwatch import DiskWatch
from worker.agent.job_diagnosis import JobDiagnosis
from worker.agent.job_run import JobRunner
from worker.agent.launch import free_port
from worker.agent.link import ServerLink
from worker.agent.outbox import Outbox
from worker.agent.running import Emitter, Requested, RunningJob
from worker.agent.sysloop import SystemReporter
from worker.agent.sysmetrics import describe_device, gpu_info
from worker.agent.warm import WarmStart

log = logging.getLogger("tokenpulse.agent")


# After an attempt ends, claims are retried this long at a short interval (not left to the idle wait).
REQUEUE_WATCH_S = 5.0


class Agent:
    def __init__(self, server: str, token: str, work_dir: Path, name: Optional[str] = None,
                 capacity: int = 1, heartbeat_s: float = 2.0, flush_s: float = 0.25,
                 poll_s: float = 1.0, grace_s: float = 10.0, stall: Optional[StallConfig] = None,
                 resume_roots: Optional[list[Path]] = None, allow_commands: bool = False,
                 snapshot_s: float = 10.0, address: Optional[str] = None, warm_start: bool = True):
        # where the other agents of a multi-node job reach this one (its node may host the rendezvous)
        self.address = address or socket.gethostname()
        self.server = server.rstrip("/")
        # Checkpoints this agent will load (torch.load runs pickles): under these directories only,
        # so a path reported by another (possibly compromised) agent token cannot point it anywhere.
        # Default: beside its own work dir (agents of one `tokenpulse up` share that parent).
        self.resume_roots = [Path(p).resolve() for p in (resume_roots or [Path(work_dir).resolve().parent])]
        self.work_dir = work_dir
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.capacity = capacity
        # Command jobs are code execution on this machine: taken only when the operator says so.
        self.allow_commands = allow_commands
        self.poll_s, self.grace_s = poll_s, grace_s
        self.outbox = Outbox(work_dir / "journal")
        self.jobs: dict[int, RunningJob] = {}
        # Jobs whose process has ended but whose events (the final state among them) the server has not
        # all acknowledged: they stay in heartbeats (job -> its last alive time) until it has, so a
        # backlog longer than a lease never makes the server take a finished job for a lost one.
        delivering: dict[int, float] = {}
        self.flush_now = asyncio.Event()
        self.stopping = False
        self.stopped = asyncio.Event()  # set with stopping, to wake waits that should end
        self.emit = Emitter(self.outbox, self.flush_now)
        self.disk = DiskWatch(work_dir, self.name, self.outbox, self.jobs, self.emit)
        self.link = ServerLink(self.server, token, hello=self.hello, outbox=self.outbox, jobs=self.jobs,
                               delivering=delivering, flush_now=self.flush_now, stopped=self.stopped,
                               heartbeat_s=heartbeat_s, flush_s=flush_s, before_flush=self.disk.watch,
                               on_commands=lambda c, sent: self.runs.commands.handle(c, sent))  # the runner, made below
        gpu, gpu_bf16 = gpu_info()
        diagnosis = JobDiagnosis(self.emit, self.link.call, lambda: self.link.agent_id)
        self.runs = JobRunner(name=self.name, server=self.server, work_dir=work_dir, resume_roots=self.resume_roots,
                              stall_config=stall or StallConfig.from_env(),  # TOKENPULSE_STALL_* over the defaults
                              gpu=gpu, gpu_bf16=gpu_bf16, grace_s=grace_s,
                              snapshot_s=snapshot_s,  # a progress bar redrawing without a newline: a line per this
                              outbox=self.outbox, flush_now=self.flush_now, jobs=self.jobs, delivering=delivering,
                              emit=self.emit, disk=self.disk, diagnosis=diagnosis,
                              warm=WarmStart(self.server, work_dir / "cache",
                                             off=None if warm_start else "warm start is off (agent --no-warm-start)"))
        self.system = SystemReporter(self.jobs, self.emit, self.link.post_system, lambda: self.link.agent_id,
                                     self.stopped)

    def hello(self) -> AgentHello:
        """Who this agent is, for its registration; `instance` (host and work dir) lets a restarted
        agent register under its old row."""
        host = socket.gethostname()
        return AgentHello(name=self.name, host=host, device=describe_device(), capacity=self.capacity,
                          accepts_commands=self.allow_commands,
                          instance=hashlib.sha256(f"{host}:{self.work_dir.resolve()}".encode()).hexdigest()[:32])

    # ---- main loop -----------------------------------------------------------------------------

    async def run(self, max_jobs: Optional[int] = None, until_idle: bool = False) -> None:
        """Claim and run jobs until stopped (or after max_jobs, or when the queue is empty)."""
        self.outbox.recover()
        await asyncio.get_running_loop().run_in_executor(None, tree.sweep)  # trees of agents killed here
        link = self.link
        await link.register()
        if link.agent_id is None:
            await link.close()
            return
        loops = [asyncio.create_task(link.heartbeat_loop()), asyncio.create_task(link.flush_loop()),
                 asyncio.create_task(link.channel.run()), asyncio.create_task(self.system.run())]
        self.runs.warm.refill()  # the zygote the jobs start in (warm.py)
        try:
            while not self.stopping:
                if max_jobs is not None and self.runs.done_jobs + len(self.jobs) >= max_jobs:
                    if not self.jobs:
                        break
                elif len(self.jobs) < self.capacity and not self.disk.blocked():
                    # the offer: where this node would host a multi-node job's rendezvous
                    offer = {"endpoint": f"{self.address}:{free_port('')}"}
                    claimed_at = time.monotonic()
                    r = await link.call("POST", f"/api/agents/{link.agent_id}/claim", json=offer, until_stopped=True)
                    if r is None:
                        break
                    if r.status_code == 200:
                        await self.runs.start_job(Claim.model_validate(r.json()))
                        continue
                    if r.status_code == 202:  # gathering a multi-node job's gang: ask again soon
                        await asyncio.sleep(min(self.poll_s, 0.5))
                        continue
                    if r.status_code == 404:  # the server forgot us (new database): register again
                        await link.register()
                        continue
                    if r.status_code in (401, 403):  # revoked or wrong token: say so, keep trying slowly
                        log.error("claim refused (%s): %s", r.status_code, r.text[:300])
                        await asyncio.sleep(max(self.poll_s, 5.0))
                        continue
                    if until_idle and not self.jobs:
                        break
                    if r.status_code == 204 and time.monotonic() - self.runs.finished_at < REQUEUE_WATCH_S:
                        # an attempt just ended here: its end (a fix's relaunch, a retry, a preemption) may
                        # requeue it a moment after this claim, its last events still on their way: ask again
                        await asyncio.sleep(min(self.poll_s, 0.5))
                        continue
                    if r.status_code == 204:  # nothing for us: on the socket, until the server says a job waits
                        await link.channel.wait_for_work(claimed_at, self.poll_s, self.stopped)
                        continue
                await asyncio.sleep(self.poll_s)
            while self.jobs:
                await asyncio.sleep(0.2)
            await link.drain()
        finally:
            for t in loops:
                t.cancel()
            await self.runs.warm.close()
            await link.close()

    async def stop(self) -> None:
        """Stop claiming. What runs is not the operator's to cancel: each job checkpoints (as for a
        pause) and goes back to the queue, to resume from that checkpoint here later or elsewhere."""
        self.stopping = True
        self.stopped.set()
        asyncio.create_task(self.runs.warm.close())  # no job for it any more
        for rj in self.jobs.values():
            if rj.requested in (None, Requested.PAUSE_REFUSED):
                rj.requested = Requested.SHUTDOWN
                how = ("checkpointing to requeue" if rj.command is None or rj.pausable else
                       "stopping the command (it cannot checkpoint) to requeue it")
                self.emit(rj, "log", {"line": f"agent {self.name} stopping: {how}", "stream": "agent"})
        for rj in self.jobs.values():
            rj.asked_at = time.time()
        # SIGUSR2: checkpoint and exit paused. A command job that never said it can (pausable) would
        # die of SIGUSR2's default action: it gets SIGTERM, and the retry policy requeues it.
        await asyncio.gather(*(rj.process.stop(signal.SIGUSR2 if rj.requested == Requested.SHUTDOWN and (
            rj.command is None or rj.pausable) else signal.SIGTERM, max(self.grace_s, 60))
            for rj in self.jobs.values()), return_exceptions=True)
