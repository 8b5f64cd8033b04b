"""The Slurm executor (`tokenpulse agent --slurm`): an agent that claims jobs like any other but runs
each as a Slurm batch job, where `sbatch` works (a login node).

  claim (ClaimRequest.slurm) -> the job's own credential (Claim.job_token, for this attempt alone)
  -> <work dir>/slurm/job-<id>/attempt-<n>/: claim.json, token (0600), batch.sh
  -> sbatch: nodes = nnodes, one task per node, GPUs (nproc_per_node per node on GPU partitions)
     or CPUs, memory, time limit from the spec's `slurm` fields; --signal=B:USR2@<signal_before_s>;
     job name tp-<id>.<attempt>, comment tokenpulse:<this executor>:<id>:<attempt>
  -> batch.sh: srun one node process per node (worker/agent/slurm_node.py), which runs the job as an
     agent would and reports it with the job's credential
  -> this executor watches squeue: while Slurm holds the job pending it reports the reason (phase
     "pending in Slurm"); once the node process runs, the job is `held` in its heartbeats (the node
     process beats for it); when the Slurm job ends and the node process did not report the end
     (scancel by someone else, TIMEOUT, PREEMPTED, NODE_FAIL, OUT_OF_MEMORY), Slurm's record (sacct,
     or `scontrol show job` without accounting) is the end, in tokenpulse's failure kinds.
  Cancel: scancel (at once while pending; after the node process had its grace otherwise). Pause:
  the node process checkpoints and exits (the allocation ends); while pending, scancel. Resume
  submits again from the checkpoint.

Stateless: everything it needs is in Slurm's queue (names and comments) and on the server (GET
/api/agents/{id}/jobs/{job}); killed and restarted with the same work dir, it registers under its
old row and goes on watching the Slurm jobs it submitted.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shlex
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tokenpulse.protocol import Action, AgentHello, Claim, Command, ExitVerdict, Failure, Phase
from worker.agent import slurm_cli
from worker.agent.link import ServerLink
from worker.agent.outbox import Outbox
from worker.agent.slurm_cli import QueuedJob
from worker.agent.slurm_sbatch import Sbatch, batch_script

log = logging.getLogger("tokenpulse.slurm")


@dataclass
class _LeadShare:
    """What link.py's heartbeat reads of a job's claim: this executor reports for node rank 0."""
    node_rank: int = 0


@dataclass
class Tracked:
    """A Slurm job this executor submitted for a tokenpulse job's attempt. Shaped for link.py's
    heartbeat (claim.node_rank, alive_at, gang) while Slurm holds it pending."""
    job_id: int
    attempt: int
    slurm_id: str
    claim: _LeadShare = field(default_factory=_LeadShare)
    alive_at: float = field(default_factory=time.time)
    gang: None = None
    state: str = "PENDING"
    reason: str = ""
    running: bool = False  # the node process reports for it
    cancelled_by_us: bool = False
    cancel_asked_at: Optional[float] = None


def ending(rec: dict[str, str], slurm_id: str, ours: bool, cancel_asked: bool) -> ExitVerdict:
    """Slurm's record of a job whose node process reported no end, in tokenpulse's words."""
    state = (rec.get("State") or "UNKNOWN").split()[0]
    said = slurm_cli.summary(rec) if rec else "no record (sacct and scontrol do not know it)"
    where = f"Slurm job {slurm_id}"
    code = rec.get("ExitCode", "")
    if state.startswith("CANCELLED") and (ours or cancel_asked):
        return ExitVerdict(state="cancelled", reason=f"cancelled by user: {where} cancelled (scancel); {said}")
    if state.startswith("CANCELLED"):
        by = state.partition(" by ")[2] if " by " in (rec.get("State") or "") else ""
        return ExitVerdict(state="failed", failure=Failure.CANCELLED_OUTSIDE, retry=False,
                           reason=f"{where} was cancelled outside tokenpulse (scancel{' by uid ' + by if by else ''}); "
                                  f"{said}")
    if state == "PREEMPTED":  # not the job's fault: back to the queue, no retry spent (as a SIGTERM from outside)
        return ExitVerdict(state="queued", failure=Failure.PREEMPTED,
                           reason=f"{where} was preempted; resumes from its newest checkpoint; {said}")
    kinds = {"TIMEOUT": (Failure.TIMEOUT, "hit its time limit before a checkpoint saved its work"),
             "DEADLINE": (Failure.TIMEOUT, "reached its deadline"),
             "NODE_FAIL": (Failure.NODE_FAIL, "lost a node (NODE_FAIL)"),
             "BOOT_FAIL": (Failure.NODE_FAIL, "could not boot its nodes (BOOT_FAIL)"),
             "OUT_OF_MEMORY": (Failure.OOM, "ran out of memory (Slurm's OUT_OF_MEMORY)")}
    if state in kinds:
        failure, words = kinds[state]
        return ExitVerdict(state="failed", failure=failure, retry=True, reason=f"{where} {words}; {said}")
    return ExitVerdict(state="failed", failure=Failure.LOST, retry=True,
                       reason=f"{where} ended ({state}{', exit code ' + code if code else ''}) without its node "
                              f"process reporting the end; {said}")


class SlurmExecutor:
    def __init__(self, server: str, token: str, work_dir: Path, name: Optional[str] = None, capacity: int = 8,
                 partition: Optional[str] = None, account: Optional[str] = None,
                 sbatch_args: Optional[list[str]] = None, allow_commands: bool = False, poll_s: float = 1.0,
                 heartbeat_s: float = 2.0, flush_s: float = 0.25, cancel_grace_s: float = 30.0):
        self.server = server.rstrip("/")
        self.work_dir = Path(work_dir).resolve()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.name = name or f"slurm-{socket.gethostname()}-{os.getpid()}"
        self.capacity, self.allow_commands, self.poll_s = capacity, allow_commands, poll_s
        self.cancel_grace_s = cancel_grace_s
        self.instance = hashlib.sha256(f"{socket.gethostname()}:{self.work_dir}".encode()).hexdigest()[:32]
        self.tag = f"tokenpulse:{self.instance[:12]}"
        self.sbatch = Sbatch(self.tag, partition, account, list(sbatch_args or []))  # each attempt's request
        self.outbox = Outbox(self.work_dir / "journal")
        self.tracked: dict[int, Tracked] = {}
        self.pending: dict[int, Tracked] = {}  # what the heartbeats vouch for: Slurm holds them pending
        self.delivering: dict[int, float] = {}
        self.flush_now = asyncio.Event()
        self.stopped = asyncio.Event()
        self.stopping = False
        self.link = ServerLink(self.server, token, hello=self.hello, outbox=self.outbox, jobs=self.pending,  # type: ignore[arg-type]
                               delivering=self.delivering, flush_now=self.flush_now, stopped=self.stopped,
                               heartbeat_s=heartbeat_s, flush_s=flush_s, on_commands=self.handle,
                               before_flush=lambda: None, held=lambda: [t.job_id for t in self.tracked.values()
                                                                        if t.running])
        self.claim_after = 0.0  # monotonic: no claims before (Slurm's controller unreachable)

    def hello(self) -> AgentHello:
        return AgentHello(name=self.name, host=socket.gethostname(), device="slurm", capacity=self.capacity,
                          accepts_commands=self.allow_commands, instance=self.instance)

    def emit(self, job_id: int, kind: str, data: dict) -> None:
        self.outbox.add(job_id, kind, data)
        self.flush_now.set()

    # ---- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        self.outbox.recover()
        await self.link.register()
        if self.link.agent_id is None:
            return
        loops = [asyncio.create_task(self.link.heartbeat_loop()), asyncio.create_task(self.link.flush_loop()),
                 asyncio.create_task(self.watch_loop())]
        try:
            await self.adopt()
            while not self.stopping:
                if len(self.tracked) < self.capacity and time.monotonic() >= self.claim_after \
                        and await self.claim_one():
                    continue
                try:
                    await asyncio.wait_for(self.stopped.wait(), self.poll_s)
                except asyncio.TimeoutError:
                    pass
            await self.link.drain(timeout=10)
        finally:
            for t in loops:
                t.cancel()
            await self.link.close()

    async def stop(self) -> None:
        """Stop claiming and watching. The Slurm jobs go on: a restart finds them (adopt)."""
        self.stopping = True
        self.stopped.set()

    async def claim_one(self) -> bool:
        r = await self.link.call("POST", f"/api/agents/{self.link.agent_id}/claim", json={"slurm": True},
                                 until_stopped=True)
        if r is None or r.status_code != 200:
            if r is not None and r.status_code in (401, 403):
                log.error("claim refused (%s): %s", r.status_code, r.text[:300])
            return False
        await self.submit(Claim.model_validate(r.json()))
        return True

    # ---- submitting -----------------------------------------------------------------------------

    def job_dir(self, job_id: int) -> Path:
        return self.work_dir / "slurm" / f"job-{job_id}"

    async def submit(self, claim: Claim) -> None:
        attempt_dir = self.job_dir(claim.job_id) / f"attempt-{claim.attempt}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        self.outbox.open_job(claim.job_id, claim.seq_start)
        token = attempt_dir / "token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(claim.job_token or "")
        (attempt_dir / "claim.json").write_text(json.dumps({
            "server": self.server, "agent_id": self.link.agent_id, "job_id": claim.job_id, "attempt": claim.attempt,
            "job_dir": str(self.job_dir(claim.job_id)), "resume_roots": [str(self.work_dir)]}))
        script = attempt_dir / "batch.sh"
        script.write_text(batch_script(attempt_dir))
        try:
            opts = await self.sbatch.options(claim, attempt_dir)
            slurm_id = await slurm_cli.submit(opts, str(script))
        except slurm_cli.SlurmError as e:
            if slurm_cli.unreachable(str(e)):  # Slurm's controller, not the job: back to the queue, no retry spent
                verdict = ExitVerdict(state="queued",
                                      reason=f"{self.name}: sbatch could not reach Slurm ({e}); requeued")
                self.claim_after = time.monotonic() + 30
            else:
                verdict = ExitVerdict(state="failed", failure=Failure.SPEC, reason=f"sbatch refused the job: {e}")
            self.emit(claim.job_id, "state", verdict.model_dump(exclude_none=True))
            self.delivering[claim.job_id] = time.time()
            return
        t = Tracked(claim.job_id, claim.attempt, slurm_id)
        self.tracked[claim.job_id] = self.pending[claim.job_id] = t
        (attempt_dir / "sbatch").write_text(f"sbatch {shlex.join(opts)} {script}")  # the node process logs it
        # info alone: the job stays `starting` while Slurm holds it (a log line would make it running)
        self.emit(claim.job_id, "info", {"slurm": {"job_id": slurm_id, "state": "PENDING",
                                                   "submitted_by": self.name}})

    # ---- watching -----------------------------------------------------------------------------

    async def adopt(self) -> None:
        """After a restart: the Slurm jobs this executor submitted (their comment), watched again
        when the server still holds their attempt for it; cancelled when it does not."""
        try:
            queue = await slurm_cli.queue()
        except slurm_cli.SlurmError as e:
            log.error("squeue: %s", e)
            return
        for q in queue:
            parts = q.comment.split(":")
            if len(parts) != 4 or ":".join(parts[:2]) != self.tag:
                continue
            job_id, attempt = int(parts[2]), int(parts[3])
            got = await self.standing(job_id)
            if got is None or not got["held"] or got["attempt"] != attempt:
                if not q.finished:
                    log.info("Slurm job %s: tokenpulse job %s attempt %s is over: scancel", q.slurm_id, job_id, attempt)
                    await slurm_cli.cancel(q.slurm_id)
                continue
            t = Tracked(job_id, attempt, q.slurm_id, state=q.state, reason=q.reason, running=not q.pending)
            self.tracked[job_id] = t
            if q.pending:
                self.pending[job_id] = t
                self.outbox.open_job(job_id, got["next_seq"])
            log.info("adopted Slurm job %s (tokenpulse job %s, attempt %s, %s)", q.slurm_id, job_id, attempt, q.state)

    async def standing(self, job_id: int) -> Optional[dict]:
        r = await self.link.call("GET", f"/api/agents/{self.link.agent_id}/jobs/{job_id}")
        return r.json() if r.status_code == 200 else None

    async def watch_loop(self) -> None:
        while True:
            try:
                await self.watch()
            except Exception:
                log.exception("watching Slurm failed")
            await asyncio.sleep(self.poll_s)

    async def watch(self) -> None:
        watched = list(self.tracked.values())  # not one submitted while squeue answers: it is not in its answer
        if not watched:
            return
        queue = {q.slurm_id: q for q in await slurm_cli.queue()}
        now = time.time()
        for t in watched:
            if self.tracked.get(t.job_id) is not t:
                continue  # settled meanwhile (a command)
            q = queue.get(t.slurm_id)
            if q is None or q.finished:
                await self.settle(t, q)
            elif q.pending:
                t.alive_at = now
                if (q.state, q.reason) != (t.state, t.reason):
                    t.state, t.reason = q.state, q.reason
                    self.emit(t.job_id, "phase", {"name": Phase.SLURM_PENDING,
                                                  "detail": f"Slurm job {t.slurm_id} {q.state.lower()}: {q.reason}"})
                    self.emit(t.job_id, "info", {"slurm": {"job_id": t.slurm_id, "state": q.state, "reason": q.reason}})
            else:
                t.state = q.state
                if not t.running:  # the node process reports from now on
                    t.running = True
                    self.pending.pop(t.job_id, None)
                if t.cancel_asked_at is not None and now - t.cancel_asked_at > self.cancel_grace_s \
                        and not t.cancelled_by_us:
                    log.info("job %s: cancel asked %.0f s ago, Slurm job %s still runs: scancel", t.job_id,
                             now - t.cancel_asked_at, t.slurm_id)
                    t.cancelled_by_us = True
                    await slurm_cli.cancel(t.slurm_id)

    async def settle(self, t: Tracked, q: Optional[QueuedJob]) -> None:
        """The Slurm job is over. Its node process reported the end (the server holds the attempt no
        more), or Slurm's record is the end."""
        self.tracked.pop(t.job_id, None)
        self.pending.pop(t.job_id, None)
        got = await self.standing(t.job_id)
        if got is None or not got["held"] or got["attempt"] != t.attempt:
            return
        rec = await slurm_cli.record(t.slurm_id)
        if not rec and q is not None:
            rec = {"State": q.state, "Reason": q.reason, "source": "squeue"}
        verdict = ending(rec, t.slurm_id, t.cancelled_by_us, t.cancel_asked_at is not None)
        tail = self.batch_output(t)
        if tail and verdict.state == "failed":  # what the batch script said (a node process that never started)
            verdict.reason = f"{verdict.reason}\nbatch output (last lines):\n{tail}"[:8000]
        self.outbox.open_job(t.job_id, got["next_seq"])  # past what the node process reported
        self.emit(t.job_id, "info", {"slurm": {"job_id": t.slurm_id, "state": (rec.get("State") or "").split(" ")[0],
                                               "record": rec}})
        self.emit(t.job_id, "log", {"line": f"Slurm job {t.slurm_id} ended: {slurm_cli.summary(rec)}",
                                    "stream": "agent"})
        self.emit(t.job_id, "state", verdict.model_dump(exclude_none=True))
        self.delivering[t.job_id] = time.time()

    def batch_output(self, t: Tracked, lines: int = 15) -> str:
        path = self.job_dir(t.job_id) / f"attempt-{t.attempt}" / f"slurm-{t.slurm_id}.out"
        try:
            with path.open("rb") as f:
                f.seek(max(0, path.stat().st_size - 16384))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # ---- a person's requests --------------------------------------------------------------------

    async def handle(self, commands: list[Command], sent: float = 0.0) -> None:
        """A person's requests for the Slurm jobs tracked here. `sent` (when the message they answer
        left) is not used here: the agent's job runner uses it to tell a command about an earlier
        attempt of a job claimed back from one for the attempt it runs now."""
        for c in commands:
            t = self.tracked.get(c.job_id)
            if t is None:
                continue
            if c.action in (Action.CANCEL, Action.PAUSE) and not t.running and not t.cancelled_by_us:
                now = {q.slurm_id: q for q in await slurm_cli.queue()}.get(t.slurm_id)
                if now is not None and not now.pending and not now.finished:  # started since the last look
                    t.running = True
                    self.pending.pop(t.job_id, None)
            if c.action in (Action.CANCEL, Action.PAUSE) and not t.running and not t.cancelled_by_us:
                # nothing runs yet: Slurm lets it go, and the job says so itself
                t.cancelled_by_us = True
                await slurm_cli.cancel(t.slurm_id)
                self.tracked.pop(t.job_id, None)
                self.pending.pop(t.job_id, None)
                state = "cancelled" if c.action == Action.CANCEL else "paused"
                self.emit(t.job_id, "state", {"state": state, "reason": f"{state} while pending in Slurm "
                                                                        f"(Slurm job {t.slurm_id} cancelled)"})
                self.delivering[t.job_id] = time.time()
            elif c.action == Action.CANCEL and t.cancel_asked_at is None:
                t.cancel_asked_at = time.time()  # the node process stops it; scancel after its grace (watch)
