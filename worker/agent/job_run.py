"""One job's run, from its claim to its end: its process started (the training process, or a command
in its directory with its environment), its events and output read, supervised while it runs, the
server's commands for it carried out (cancel, pause, stack), and its exit judged (exits.py).

It is handed the other rooms it needs: `emit` (events out, running.py), the job's diagnosis
(job_diagnosis.py) and the disk watch (diskwatch.py)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Optional

from tokenpulse.diagnosis.stall import StallConfig, StallDetector
from tokenpulse.protocol import Claim, CommandSpec, ExitVerdict, Failure
from worker.agent import gangwatch, sysmetrics
from worker.agent.advice import OWNED, Advisor
from worker.agent.child import CommandProcess, TrainingProcess
from worker.agent.disk import disk_words
from worker.agent.diskwatch import DiskWatch
from worker.agent.exits import close_alerts, final_verdict
from worker.agent.job_commands import JobCommands
from worker.agent.job_diagnosis import JobDiagnosis
from worker.agent.job_setup import (
    command_env,
    command_resume,
    confined_cwd,
    instrumentation_dir,
    pick_resume,
    prune_own_checkpoints,
)
from worker.agent.job_stream import JobStream
from worker.agent.launch import Gang, command, is_distributed, launches_ranks, training_args
from worker.agent.outbox import Outbox
from worker.agent.output import Masker
from worker.agent.printed_metrics import JobMetrics
from worker.agent.ranks import RankBoard
from worker.agent.running import Emitter, Requested, RunningJob
from worker.agent.slow import SlowDetector
from worker.agent.tree import JobTree
from worker.agent.warm import StandbyLost, WarmStart, start_in

log = logging.getLogger("tokenpulse.agent")


TRAIN_KILL_AFTER_S = 1800.0  # tokenpulse's own training: a stall alerted this long ago is a hang


def kill_after(stall: StallConfig, command: bool) -> float:
    """Seconds after a stall alert that the attempt is ended as a hang (0: never): the job's
    stall.kill_after_s, else the agent's TOKENPULSE_STALL_KILL_AFTER_S, else by kind: tokenpulse's own
    loop has no reason to sit still for half an hour past its learned timeout; a command may wait on
    purpose (a prompt, a silent download), so it is never killed unless asked."""
    if stall.kill_after_s >= 0:
        return stall.kill_after_s
    return 0.0 if command else TRAIN_KILL_AFTER_S


def new_gang(stall: StallConfig) -> gangwatch.GangState:
    """A distributed job's ranks, its straggler rule holding and clearing like its other alerts."""
    return gangwatch.GangState(board=RankBoard(open_s=stall.alert_open_s, clear_s=stall.alert_clear_s))


class JobRunner:
    def __init__(self, *, name: str, server: str, work_dir: Path, resume_roots: list[Path], stall_config: StallConfig,
                 gpu: Optional[str], gpu_bf16: bool, grace_s: float, snapshot_s: float, outbox: Outbox,
                 flush_now: asyncio.Event, jobs: dict[int, RunningJob], delivering: dict[int, float],
                 emit: Emitter, disk: DiskWatch, diagnosis: JobDiagnosis, warm: WarmStart):
        self.name, self.server, self.work_dir, self.resume_roots = name, server, work_dir, resume_roots
        self.stall_config, self.gpu, self.gpu_bf16 = stall_config, gpu, gpu_bf16
        self.grace_s, self.snapshot_s = grace_s, snapshot_s
        self.outbox, self.flush_now, self.emit, self.disk, self.diagnosis = outbox, flush_now, emit, disk, diagnosis
        self.jobs = jobs  # running now
        # Jobs whose process has ended but whose events (the final state among them) the server has not
        # all acknowledged: they stay in heartbeats (job -> its last alive time) until it has (link.py).
        self.delivering = delivering
        self.done_jobs = 0
        self.finished_at = 0.0  # monotonic time an attempt last ended here (agent.py: its requeue follows)
        self.stream = JobStream(emit, snapshot_s)  # its events and output read
        self.warm = warm  # the standby tokenpulse's own training starts in (warm.py)
        self.commands = JobCommands(jobs, emit, diagnosis, grace_s)  # the server's requests for them

    async def take_back(self, claim: Claim) -> None:
        """The server gave a job out again while this agent still holds an earlier attempt of it (it took
        the job from this agent when a lease ran out on a busy machine, then this agent claimed it
        back): that attempt is over in the server's eyes. Its process is stopped before the new one
        starts (they share the job's directory), and its events not yet delivered are dropped: sent
        now, they would be stored as the new attempt's, its final state ending the new attempt."""
        old = self.jobs.pop(claim.job_id, None)
        delivering = self.delivering.pop(claim.job_id, None) is not None
        if old is None and not delivering:  # (events of a journal replayed after a restart are sent)
            return
        dropped = self.outbox.forget(claim.job_id)
        log.warning("job %s: claimed again as attempt %s while attempt %s %s here (the server ended it): "
                    "%s undelivered events of it dropped", claim.job_id, claim.attempt,
                    old.claim.attempt if old else "before it", "still ran" if old else "was delivering", dropped)
        if old is not None:
            old.superseded = True
            old.requested = Requested.CANCEL
            await old.process.stop(signal.SIGTERM, self.grace_s)

    async def start_job(self, claim: Claim) -> None:
        await self.take_back(claim)
        job_dir = self.work_dir / "jobs" / str(claim.job_id)
        if self.disk.blocked():  # claimed as the disk filled (the claim was asked for just before)
            return self.hand_back(claim)
        if isinstance(claim.spec, CommandSpec):
            return await self.start_command(claim, claim.spec, job_dir)
        spec_path = job_dir / "spec.json"
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            spec_path.write_text(claim.spec.model_dump_json(indent=2))
        except OSError as e:
            self.disk.error = disk_words(self.work_dir, e)
            return self.hand_back(claim)
        self.outbox.open_job(claim.job_id, claim.seq_start)
        resume, resume_note = pick_resume(claim.resume_from, self.resume_roots)
        prune_own_checkpoints(job_dir / "out", resume)
        stall = self.stall_config.merged(claim.spec.stall.model_dump())
        argv, fifo = None, None
        if is_distributed(claim.spec):  # torchrun around the training process, one event FIFO for all ranks
            argv = command(claim.spec, training_args(spec_path, job_dir / "out", self.work_dir / "cache",
                                                     str(resume) if resume else None),
                           Gang(node_rank=claim.node_rank, endpoint=claim.rdzv_endpoint,
                                run_id=f"tokenpulse-{claim.job_id}-{claim.attempt}"))
            fifo = job_dir / "events.fifo"
        proc = TrainingProcess(spec_path, job_dir / "out", self.work_dir / "cache", str(resume) if resume else None,
                               command=argv, fifo=fifo)
        proc.tree = JobTree.for_job(self.server, claim.job_id, claim.attempt)
        proc.tree.warm_record = job_dir / "warm_tags"  # attempts started warm: their standbys' tags
        proc.control_file = job_dir / "control"  # the agent's word before its own SIGTERM (child.py)
        rj = RunningJob(claim=claim, process=proc, detector=StallDetector(stall),
                        slow=SlowDetector(stall, gpu=self.gpu, gpu_bf16=self.gpu_bf16),
                        gang=new_gang(stall) if fifo else None, kill_after_s=kill_after(stall, command=False))
        self.jobs[claim.job_id] = rj
        self.emit(rj, "log", {"line": f"agent {self.name}: attempt {claim.attempt}: {resume_note}", "stream": "agent"})
        standby, plainly = (None, "a distributed job: torchrun starts its ranks") if argv else await self.warm.take()
        try:
            if standby is not None:
                try:
                    said = await start_in(proc, standby)
                    self.emit(rj, "log", {"line": f"agent {self.name}: started warm: {said}", "stream": "agent"})
                except StandbyLost as e:  # it ended as it was handed the job: a new process instead
                    standby, plainly = None, str(e)
            if standby is None:
                self.emit(rj, "log", {"line": f"agent {self.name}: started plainly: {plainly}", "stream": "agent"})
                await proc.start()
        except OSError as e:
            self.emit(rj, "state", ExitVerdict(state="failed", reason=f"could not start training: {e}",
                                              failure=Failure.CRASH).model_dump(exclude_none=True))
            self.finish(rj)
            return
        finally:  # the zygote, if there is none, once this job is past its start
            self.warm.refill_when(lambda: rj.detector.step is not None or claim.job_id not in self.jobs)
        if rj.requested == Requested.CANCEL:  # asked while it started (stop() had no process yet)
            asyncio.create_task(rj.process.stop(signal.SIGTERM, self.grace_s))
        self.watch(rj)

    def hand_back(self, claim: Claim) -> None:
        """A full disk: the job is not ours to fail; back to the queue, no retry spent."""
        log.error("job %s: %s; requeued: no claims until space returns", claim.job_id, self.disk.error)
        self.outbox.open_job(claim.job_id, claim.seq_start)
        self.outbox.add(claim.job_id, "state", {"state": "queued", "reason": f"agent {self.name}: "
                                                f"{self.disk.error}; requeued"})
        self.delivering[claim.job_id] = time.time()  # in heartbeats until the requeue is acknowledged
        self.done_jobs += 1
        self.flush_now.set()

    async def start_command(self, claim: Claim, spec: CommandSpec, job_dir: Path) -> None:
        """A command job (spec: its claim's): the command as given, in its working directory, with its
        environment, the event pipe and (unless instrument is off) the instrumentation hook on its PYTHONPATH."""
        mask = Masker(os.environ[n] for n in spec.secret_env if n in os.environ)
        self.outbox.open_job(claim.job_id, claim.seq_start, mask)  # every event it sends, masked
        cwd = Path(spec.cwd) if spec.cwd else job_dir / "work"
        if not spec.cwd:
            cwd.mkdir(parents=True, exist_ok=True)
        outside = None
        if spec.cwd:  # checked at the point of use: what the path resolves to now, not at submit
            cwd, outside = confined_cwd(spec.cwd, claim.path_roots)
        resume, resume_note = command_resume(claim.resume_from, self.resume_roots, cwd)
        hooks = instrumentation_dir() if spec.instrument else None
        env = command_env(os.environ, spec, claim.job_id, resume, hooks)
        argv = spec.command
        if is_distributed(spec):  # the command once per rank, under torchrun
            argv = command(spec, spec.command, Gang(run_id=f"tokenpulse-{claim.job_id}-{claim.attempt}"),
                           no_python=True)
        launcher = is_distributed(spec) or launches_ranks(spec.command)
        proc = CommandProcess(argv, cwd, env, launcher=launcher)
        proc.tree = JobTree.for_job(self.server, claim.job_id, claim.attempt)
        proc.control_file = job_dir / "control"  # the agent's word before its own SIGTERM (child.py)
        stall = self.stall_config.merged(spec.stall.model_dump())
        rj = RunningJob(claim=claim, process=proc, detector=StallDetector(stall), kill_after_s=kill_after(stall, True),
                        # padding and step size: judged by the advisor, with the script's own fix
                        slow=SlowDetector(stall, gpu=self.gpu, gpu_bf16=self.gpu_bf16, owned=OWNED), cwd=cwd,
                        gang=new_gang(stall) if launcher else None,
                        mask=mask, advice=Advisor(stall, gpu=self.gpu, gpu_bf16=self.gpu_bf16),
                        sourced=JobMetrics(env))
        self.jobs[claim.job_id] = rj
        how = ("instrumented (startup hook on PYTHONPATH)" if hooks else
               "not instrumented (instrument: false)" if not spec.instrument else
               "not instrumented (this agent has no tokenpulse.instrument)")
        self.emit(rj, "log", {"line": f"agent {self.name}: attempt {claim.attempt}: running {spec.label()} in {cwd}; "
                                      f"{how}; {resume_note}", "stream": "agent"})
        problem = None
        missing = [n for n in spec.secret_env if n not in os.environ]
        if missing:
            problem = (f"secret_env names {', '.join(missing)}, not set in the environment of agent {self.name}: "
                       f"set {'it' if len(missing) == 1 else 'them'} where the agent starts, or drop "
                       f"{'it' if len(missing) == 1 else 'them'} from the job")
        elif outside is not None:
            problem = outside
        elif not cwd.is_dir():
            problem = f"working directory {cwd} does not exist on agent {self.name} ({socket.gethostname()})"
        if problem is None:
            try:
                await proc.start()
            except OSError as e:  # no such program, not executable: the command's fault, not worth a retry
                problem = f"could not start {spec.command[0]!r}: {e.strerror or e}"
        if problem is not None:
            verdict = ExitVerdict(state="failed", reason=problem, failure=Failure.SPEC)
            self.emit(rj, "state", verdict.model_dump(exclude_none=True))
            self.finish(rj)
            return
        self.watch(rj)

    def watch(self, rj: RunningJob) -> None:
        """The process runs: read its events and output, supervise it."""
        proc = rj.process
        if proc.tree.settled:  # a retry never runs beside a survivor of the attempt before it
            self.emit(rj, "log", {"line": f"agent: killed {len(proc.tree.settled)} processes of an earlier attempt "
                                          f"of this job still running here (pids {proc.tree.settled[:20]}) "
                                          "before starting", "stream": "agent"})
        rj.detector.start(time.time())
        rj.sys = sysmetrics.TreeSampler(proc.started.pid)  # the whole tree, from now on (not its first output)
        stdout, stderr = proc.output()
        rj.tasks = [asyncio.create_task(self.stream.read_events(rj)),
                    asyncio.create_task(self.stream.read_output(rj, stdout, "stdout")),
                    asyncio.create_task(self.stream.read_output(rj, stderr, "stderr")),
                    asyncio.create_task(self.supervise(rj))]

    async def supervise(self, rj: RunningJob) -> None:
        """Watch for stalls and slowness while the process runs; then report how it ended."""
        proc = rj.process
        keeper = proc.started
        while keeper.returncode is None:
            try:
                await asyncio.wait_for(keeper.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
            if keeper.returncode is not None:
                break
            if rj.gang is not None:
                self.diagnosis.watch_gang(rj, rj.gang)
            try:
                await self.diagnosis.detect(rj, time.time())
            except Exception:  # detection must never take supervision down with it
                log.exception("job %s: detection failed", rj.claim.job_id)
        if rj.gang is not None:  # no rank outlives its launcher; then the event FIFO can end
            proc.kill_all()
            proc.release_pipe()
        # Drain the pipes: last lines, last events. A command's leftover processes (a background server,
        # a stray worker) may hold them open after it exits: the job is over, so they are killed.
        readers = rj.tasks[:3]
        if rj.command is not None:
            _, pending = await asyncio.wait(readers, timeout=2.0)
            if pending:
                proc.kill_leftovers()
                # its tree is gone, so the pipe's end comes: read what it wrote at exit (its last step,
                # lastwords.py) to the end, however loaded the machine; the bound is for a writer that escaped
                _, pending = await asyncio.wait(pending, timeout=30.0)
                for t in pending:
                    t.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await proc.release()  # its keeper killed what was left of its tree; its cgroup goes
        verdict = final_verdict(rj, keeper.returncode, self.name)
        close_alerts(rj, verdict, self.emit, disk_alert_open=self.disk.alert is not None)
        self.emit(rj, "state", verdict.model_dump(exclude_none=True))
        self.finish(rj)

    def finish(self, rj: RunningJob) -> None:
        job_id = rj.claim.job_id
        if self.jobs.get(job_id) is rj:  # (a later attempt of the job, given back to this agent, is not ended)
            del self.jobs[job_id]
            if not rj.claim.node_rank and self.outbox.pending.get(job_id):
                self.delivering[job_id] = rj.alive_at
        self.done_jobs += 1
        self.finished_at = time.monotonic()
        self.flush_now.set()
