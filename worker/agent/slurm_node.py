"""tokenpulse's process on each node of a Slurm allocation (`srun python -m worker.agent.slurm_node
<attempt dir>`, started by the batch script worker/agent/slurm_executor.py submits).

It runs its node's share of the job exactly as an agent does, with the agent's own rooms: job_run.py
starts the training process or the command (under torchrun, the rendezvous on the allocation's
first node), job_diagnosis.py judges stalls and slowness and takes stacks, link.py sends events and
heartbeats (rank rows included) until acknowledged. It speaks for the executor's agent with the
job's own credential (server/job_tokens.py: this job, this attempt, nothing else); the executor's
token never reaches the allocation.

Slurm's signals, in tokenpulse's words:
- Slurm's warning (sbatch --signal=B:USR2@N, before the time limit; at preemption with
  PreemptParameters=send_user_signal), which the batch script turns into the file `warned` in the
  attempt's directory (or SIGUSR2 sent to this process): the checkpoint request an agent's shutdown sends; the
  training process saves at its next step boundary and exits paused, and the job goes back to the
  queue (`queued`, no retry spent) to resume from that checkpoint.
- SIGTERM (scancel, the time limit, preemption): the job's processes are stopped and this process
  sends no verdict of its own: it cannot tell why Slurm ended it. The executor reads Slurm's record
  (sacct) and names the end (slurm_executor.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

from tokenpulse.diagnosis.stall import StallConfig
from tokenpulse.protocol import Claim
from worker.agent import slurm_cli
from worker.agent.diskwatch import DiskWatch
from worker.agent.job_diagnosis import JobDiagnosis
from worker.agent.job_run import JobRunner
from worker.agent.link import ServerLink
from worker.agent.outbox import Outbox
from worker.agent.running import Emitter, Requested, RunningJob
from worker.agent.sysloop import SystemReporter
from worker.agent.sysmetrics import gpu_info
from worker.agent.warm import WarmStart

log = logging.getLogger("tokenpulse.slurm")
SEQ_MARGIN = 32
RDZV_PORT_BASE = 29400  # node rank 0's rendezvous port: base + Slurm job id % 1000


class SlurmEmitter(Emitter):
    """The agent's Emitter, and what Slurm's signals change in the job's last word: after SIGTERM
    none (the executor names the end from Slurm's record); after the warning, the requeue says why."""

    def __init__(self, outbox: Outbox, flush_now: asyncio.Event, slurm_id: str):
        super().__init__(outbox, flush_now)
        self.slurm_id = slurm_id
        self.terminated = False
        self.warned = False
        # a failed or cancelled end: Slurm's SIGTERM may reach the job's processes a moment before ours
        # (proctrack signals the whole step), so it is held back until run() knows which it was
        self.held: Optional[tuple] = None

    def __call__(self, rj: RunningJob, kind: str, data: dict, t: Optional[float] = None) -> None:
        if kind == "state" and self.terminated:
            log.info("job %s: ended by Slurm (SIGTERM): its end is the executor's to name", rj.claim.job_id)
            return
        if kind == "state" and data.get("state") in ("failed", "cancelled") and self.held is None:
            self.held = (rj, kind, data, t)
            return
        if kind == "state" and self.warned and data.get("state") == "queued":
            data = {**data, "reason": f"Slurm's warning before the end of Slurm job {self.slurm_id} (time limit or "
                                      f"preemption): checkpointed; back in the queue to resume from it"}
        super().__call__(rj, kind, data, t)


class SlurmNode:
    def __init__(self, attempt_dir: Path, heartbeat_s: float = 2.0, flush_s: float = 0.25, grace_s: float = 10.0):
        cfg = json.loads((attempt_dir / "claim.json").read_text())
        self.attempt_dir = attempt_dir
        self.warn_file = attempt_dir / "warned"
        self.cfg = cfg
        token = (attempt_dir / "token").read_text().strip()
        self.slurm_id = os.environ.get("SLURM_JOB_ID", "?")
        self.node_rank = int(os.environ.get("SLURM_NODEID", "0"))
        self.name = f"slurm-{self.slurm_id}-node{self.node_rank}@{socket.gethostname()}"
        work_dir = Path(cfg["job_dir"]) / f"node-{self.node_rank}"
        work_dir.mkdir(parents=True, exist_ok=True)
        self.grace_s = grace_s
        self.outbox = Outbox(work_dir / "journal")
        self.jobs: dict[int, RunningJob] = {}
        delivering: dict[int, float] = {}
        self.flush_now = asyncio.Event()
        self.stopped = asyncio.Event()
        self.emit = SlurmEmitter(self.outbox, self.flush_now, self.slurm_id)
        self.disk = DiskWatch(work_dir, self.name, self.outbox, self.jobs, self.emit)
        self.link = ServerLink(cfg["server"], token, hello=lambda: None, outbox=self.outbox,  # type: ignore[arg-type,return-value]
                               jobs=self.jobs, delivering=delivering, flush_now=self.flush_now,
                               stopped=self.stopped, heartbeat_s=heartbeat_s, flush_s=flush_s,
                               before_flush=self.disk.watch,
                               on_commands=lambda c, sent: self.runs.commands.handle(c, sent))
        self.link.agent_id = int(cfg["agent_id"])
        gpu, gpu_bf16 = gpu_info()
        diagnosis = JobDiagnosis(self.emit, self.link.call, lambda: self.link.agent_id)
        roots = [Path(p) for p in cfg["resume_roots"]]
        self.runs = JobRunner(name=self.name, server=cfg["server"], work_dir=work_dir, resume_roots=roots,
                              stall_config=StallConfig.from_env(), gpu=gpu, gpu_bf16=gpu_bf16, grace_s=grace_s,
                              snapshot_s=10.0, outbox=self.outbox, flush_now=self.flush_now, jobs=self.jobs,
                              delivering=delivering, emit=self.emit, disk=self.disk, diagnosis=diagnosis,
                              # one job per Slurm allocation: nothing to start ahead of
                              warm=WarmStart(cfg["server"], work_dir / "cache", off="a Slurm job starts its "
                                             "training process where it lands"))
        self.system = SystemReporter(self.jobs, self.emit, self.link.post_system, lambda: self.link.agent_id,
                                     self.stopped)

    async def claim(self) -> Optional[Claim]:
        """The job as the server holds it now (its next seq: the executor may have reported while
        Slurm held it pending); None when this attempt is over."""
        r = await self.link.call("GET", f"/api/agents/{self.link.agent_id}/jobs/{self.cfg['job_id']}")
        if r.status_code != 200:
            log.error("job %s: the server refused this node (%s): %s", self.cfg["job_id"], r.status_code, r.text[:300])
            return None
        got = r.json()
        if not got["held"] or got["attempt"] != self.cfg["attempt"]:
            log.info("job %s: attempt %s is over (%s)", self.cfg["job_id"], self.cfg["attempt"], got["state"])
            return None
        claim = Claim.model_validate(got["claim"])
        # past any pending-phase note of the executor's still in flight as Slurm started the job: those
        # arrive stale and are dropped, and none of ours is taken for a replay (seq may skip)
        claim = claim.model_copy(update={"seq_start": claim.seq_start + SEQ_MARGIN})
        nnodes = int(os.environ.get("SLURM_NNODES", "1"))
        if nnodes > 1:
            first = await slurm_cli.node_address((await slurm_cli.hostnames(os.environ["SLURM_JOB_NODELIST"]))[0])
            port = RDZV_PORT_BASE + int(self.slurm_id) % 1000 if self.slurm_id.isdigit() else RDZV_PORT_BASE
            claim = claim.model_copy(update={"node_rank": self.node_rank, "rdzv_endpoint": f"{first}:{port}"})
        return claim

    def warned(self) -> None:
        """SIGUSR2 from Slurm: checkpoint and requeue, as an agent's shutdown does."""
        self.emit.warned = True
        for rj in self.jobs.values():
            if rj.requested in (None, Requested.PAUSE_REFUSED):
                rj.requested = Requested.SHUTDOWN
                self.emit(rj, "log", {"line": f"Slurm job {self.slurm_id}: warning signal before its end (time "
                                              "limit or preemption): checkpointing to requeue", "stream": "agent"})
                asyncio.create_task(self.checkpoint(rj))

    async def checkpoint(self, rj: RunningJob) -> None:
        # the process needs its SIGUSR2 handler first (installed with its first event): JobRunner.pause's wait
        while rj.claim.job_id in self.jobs and rj.process.proc is not None and rj.alive_at <= rj.born \
                and rj.process.proc.returncode is None:
            await asyncio.sleep(0.2)
        if rj.claim.job_id in self.jobs:
            pausable = rj.command is None or rj.pausable
            await rj.process.stop(signal.SIGUSR2 if pausable else signal.SIGTERM, max(self.grace_s, 120))

    async def watch_warning(self) -> None:
        """The batch script turns Slurm's warning (sbatch --signal=B:USR2@N, to the batch shell
        alone: a signal to the step would reach every process of the job, torchrun and the keeper
        included) into a file in the attempt's directory, on storage the nodes share."""
        while not self.emit.warned:
            if self.warn_file.exists():
                self.warned()
                return
            await asyncio.sleep(0.5)

    def terminated(self) -> None:
        """SIGTERM from Slurm: stop the job's processes; the executor names the end."""
        self.emit.terminated = True
        for rj in self.jobs.values():
            self.emit(rj, "log", {"line": f"Slurm job {self.slurm_id} ended by Slurm (SIGTERM): stopping",
                                  "stream": "agent"})
            asyncio.create_task(rj.process.stop(signal.SIGTERM, 3.0))

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR2, self.warned)
        loop.add_signal_handler(signal.SIGTERM, self.terminated)
        self.outbox.recover()
        claim = await self.claim()
        if claim is None:
            await self.link.close()
            return 0
        loops = [asyncio.create_task(self.link.heartbeat_loop()), asyncio.create_task(self.link.flush_loop()),
                 asyncio.create_task(self.system.run()), asyncio.create_task(self.watch_warning())]
        try:
            if self.node_rank == 0:
                self.outbox.open_job(claim.job_id, claim.seq_start)
                nodes = os.environ.get("SLURM_JOB_NODELIST", "")
                # after the start: an info event alone would keep a starting job from running
                sbatch = self.attempt_dir / "sbatch"
                how = sbatch.read_text().strip() if sbatch.exists() else "sbatch"
                self.outbox.add(claim.job_id, "log", {"line": f"attempt {claim.attempt}: Slurm job {self.slurm_id} "
                                                      f"running on {nodes}: node process {self.name}; submitted "
                                                      f"with: {how}", "stream": "agent"})
                self.outbox.add(claim.job_id, "info", {"slurm": {"job_id": self.slurm_id, "state": "RUNNING",
                                                                 "nodes": nodes}})
            await self.runs.start_job(claim)
            while self.jobs:
                await asyncio.sleep(0.2)
            if self.emit.held is not None:
                await asyncio.sleep(1.5)  # Slurm's SIGTERM, if that is what killed it
                if not self.emit.terminated:
                    Emitter.__call__(self.emit, *self.emit.held)
            await self.link.drain()
        finally:
            self.stopped.set()
            for t in loops:
                t.cancel()
            await self.link.close()
        return 143 if self.emit.terminated else 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.agent.slurm_node")
    p.add_argument("attempt_dir", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(SlurmNode(args.attempt_dir).run())


if __name__ == "__main__":
    sys.exit(main())
