"""One job's run, from its claim to its end: its process started (the training process, or a command
in its directory with its environment), its events and output read, supervised while it runs, the
server's commands for it carried out (cancel, pause, stack), and its exit judged (exits.py).

It is handed the other rooms it needs: `emit` (events out, running.py), the job's diagnosis
(job_diagnosis.py) and the disk watch (diskwatch.py)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Optional

from tokenpulse.diagnosis.stall import StallConfig, StallDetector
from tokenpulse.protocol import Action, AlertKind, Claim, Command, CommandSpec, ExitVerdict, Failure
from worker.agent import gangstacks, gangwatch, sysmetrics
from worker.agent.advice import OWNED, Advisor
from worker.agent.child import CommandProcess, TrainingProcess
from worker.agent.disk import disk_words
from worker.agent.diskwatch import DiskWatch
from worker.agent.exits import close_alerts, final_verdict
from worker.agent.job_diagnosis import JobDiagnosis
from worker.agent.job_setup import (
    command_env,
    command_resume,
    confined_cwd,
    instrumentation_dir,
    pick_resume,
    prune_own_checkpoints,
)
from worker.agent.launch import Gang, command, is_distributed, launches_ranks, training_args
from worker.agent.outbox import Outbox
from worker.agent.output import LineFolder, Masker
from worker.agent.printed_metrics import JobMetrics
from worker.agent.ranks import RankBoard
from worker.agent.running import Emitter, Requested, RunningJob
from worker.agent.slow import SlowDetector
from worker.agent.tree import JobTree

log = logging.getLogger("tokenpulse.agent")


def is_anatomy(data: dict) -> bool:
    """A rank's step-anatomy metrics (tokenpulse/instrument/patch_torch.py): stored for every rank."""
    values = data.get("values")
    return isinstance(values, dict) and bool(values) and all(str(k).startswith("anatomy/") for k in values)


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
                 emit: Emitter, disk: DiskWatch, diagnosis: JobDiagnosis):
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

    async def start_job(self, claim: Claim) -> None:
        job_dir = self.work_dir / "jobs" / str(claim.job_id)
        if isinstance(claim.spec, CommandSpec):
            return await self.start_command(claim, claim.spec, job_dir)
        spec_path = job_dir / "spec.json"
        self.outbox.open_job(claim.job_id, claim.seq_start)
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            spec_path.write_text(claim.spec.model_dump_json(indent=2))
        except OSError as e:  # a full disk: the job is not ours to fail; back to the queue, no retry spent
            self.disk.error = disk_words(self.work_dir, e)
            log.error("job %s: %s; requeued, and no claims until it can be written", claim.job_id, self.disk.error)
            self.outbox.add(claim.job_id, "state", {"state": "queued", "reason": f"agent {self.name}: "
                                                    f"{self.disk.error}; requeued"})
            self.delivering[claim.job_id] = time.time()  # in heartbeats until the requeue is acknowledged
            self.done_jobs += 1
            self.flush_now.set()
            return
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
        proc.control_file = job_dir / "control"  # the agent's word before its own SIGTERM (child.py)
        rj = RunningJob(claim=claim, process=proc, detector=StallDetector(stall),
                        slow=SlowDetector(stall, gpu=self.gpu, gpu_bf16=self.gpu_bf16),
                        gang=new_gang(stall) if fifo else None, kill_after_s=kill_after(stall, command=False))
        self.jobs[claim.job_id] = rj
        self.emit(rj, "log", {"line": f"agent {self.name}: attempt {claim.attempt}: {resume_note}", "stream": "agent"})
        try:
            await proc.start()
        except OSError as e:
            self.emit(rj, "state", ExitVerdict(state="failed", reason=f"could not start training: {e}",
                                              failure=Failure.CRASH).model_dump(exclude_none=True))
            self.finish(claim.job_id)
            return
        self.watch(rj)

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
            self.finish(claim.job_id)
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
        rj.tasks = [asyncio.create_task(self.read_events(rj)),
                    asyncio.create_task(self.read_output(rj, stdout, "stdout")),
                    asyncio.create_task(self.read_output(rj, stderr, "stderr")),
                    asyncio.create_task(self.supervise(rj))]

    async def read_events(self, rj: RunningJob) -> None:
        reader = rj.process.events
        if reader is None:  # never spawned: no event pipe
            return
        while True:
            line = await reader.readline()
            if not line:
                return
            try:
                ev = json.loads(line)
                kind, data, t = ev["kind"], ev.get("data", {}), float(ev.get("t", time.time()))
                rank = ev.get("rank")
                rank = int(rank) if rank is not None else None
            except (ValueError, KeyError, TypeError):
                self.emit(rj, "log", {"line": f"bad event line: {line[:200]!r}", "stream": "agent"})
                continue
            now = time.time()
            rj.alive_at = now
            if rank is not None and rj.gang is not None:
                rj.gang.observe(rank, kind, data, t, now)
                if rank != 0:  # other ranks: their identity, alerts and step anatomy are stored; the rest is theirs
                    if kind == "metrics" and is_anatomy(data):
                        if rj.slow is not None:
                            rj.slow.observe_anatomy(data, now)
                        self.emit(rj, kind, data, t)
                    elif kind == "alert":
                        extra = {"data": None} if rj.command is not None else {}  # as below: not a command's word
                        self.emit(rj, kind, {**data, **extra,
                                             "message": f"rank {rank}: {data.get('message', '')}"[:8192]}, t)
                    elif kind == "info":
                        self.emit(rj, kind, data, t)
                    elif kind == "state" and rj.claim.node_rank and rj.child_state is None:
                        rj.child_state = data  # another node's end is judged by its own ranks' word
                    continue
            if rj.sourced is not None:
                data = self.sourced(rj, kind, data)
                if data is None:
                    continue
            recovered = rj.detector.observe(kind, data, now)  # alive events: alive, not progress
            if recovered is not None:  # cleared once it kept moving for alert_clear_s (detect())
                rj.stall_clear = (now, recovered.message)
            if kind == "alive":
                continue  # carried by the heartbeat, not stored one by one
            if rj.slow is not None:
                rj.slow.observe(kind, data, now)
            if rj.advice is not None:
                rj.advice.observe(kind, data, now)
                if rj.detector.last_progress == now and rj.advice.quiet_over():
                    self.emit(rj, "alert", {"kind": AlertKind.QUIET, "clear": True,
                                            "message": f"progress reported again: {rj.detector.where()}"})
                    if kind != "phase" and rj.advice.phase:  # the quiet line gives way to the process's own
                        self.emit(rj, "phase", rj.advice.phase)
            if rj.command is not None:
                if kind == "alert" and "data" in data:
                    # fixes and costs are the agent's word (worker/agent/fixes.py): a command's own alert
                    # must not plant a change of its command line behind an "Apply fix" button
                    data = {k: v for k, v in data.items() if k != "data"}
                data = self.masked(rj, kind, data)
                if kind == "info" and data.get("pausable") is not None:
                    # The instrumentation's promise (a Trainer callback) that SIGUSR2 makes the process
                    # save a checkpoint and exit paused; without it a command job is never sent SIGUSR2.
                    rj.pausable = bool(data["pausable"])
            if kind == "state":
                rj.child_state = data  # judged together with the exit code, in supervise()
                continue
            if kind == "checkpoint" and not data.get("final") and data.get("requested"):
                self.emit(rj, "log", {"line": self.checkpoint_words(rj, data, now), "stream": "agent"})
            self.emit(rj, kind, data, t)

    def sourced(self, rj: RunningJob, kind: str, data: dict) -> Optional[dict]:
        """A metrics event's `sources` (and the logging calls the process names in its info) become
        the job's info `metric_sources`, sent when it changes."""
        assert rj.sourced is not None
        out = rj.sourced.observe(kind, data)
        info = rj.sourced.sources_info()
        if info is not None:
            self.emit(rj, "info", info)
        return out

    def printed_metrics(self, rj: RunningJob, line: str) -> None:
        """The last resort for a loss: the job's printed lines (printed_metrics.py)."""
        assert rj.sourced is not None
        for kind, data in rj.sourced.printed(line):
            self.emit(rj, kind, data)
        info = rj.sourced.sources_info()
        if info is not None:
            self.emit(rj, "info", info)

    @staticmethod
    def checkpoint_words(rj: RunningJob, data: dict, now: float) -> str:
        """A checkpoint that was asked for, and how long it took: the process measures from its signal,
        the agent from when it asked (a SIGTERM from outside: the agent did not ask)."""
        sig = str(data.get("requested"))
        why = {"SIGUSR2": "asked for (pause or stop)", "SIGTERM": "on a SIGTERM from outside (preemption)"}.get(
            sig, f"asked for ({sig})")
        words = (f"agent: checkpoint at step {data.get('step')} {why}: saved {data.get('request_s', 0):.1f} s "
                 "after the signal")
        if sig == "SIGUSR2" and rj.asked_at is not None:
            words += f" ({now - rj.asked_at:.1f} s after this agent asked)"
        return words

    @staticmethod
    def masked(rj: RunningJob, kind: str, data: dict) -> dict:
        """Secret values never leave the agent, even when the job's own events carry them: every
        string, keys included (the outbox masks again whatever the agent adds to it)."""
        return rj.mask.data(data)

    async def read_output(self, rj: RunningJob, stream: asyncio.StreamReader, name: str) -> None:
        """Output as log lines, progress-bar redraws folded (output.LineFolder); a line that keeps
        redrawing without a newline is logged once per snapshot_s, and only when it changed."""
        fold = LineFolder(self.snapshot_s, mask=rj.mask)  # masked before a long line is cut
        while True:
            try:
                raw = await asyncio.wait_for(stream.read(1 << 16), min(self.snapshot_s, 5.0))
            except asyncio.TimeoutError:
                lines = fold.tick(time.time())
            else:
                lines = fold.feed(raw, time.time()) if raw else fold.close()
                if not raw:
                    for line in lines:
                        self.output_line(rj, name, line)
                    return
            for line in lines:
                self.output_line(rj, name, line)

    def output_line(self, rj: RunningJob, name: str, line: str) -> None:
        if rj.command is not None:
            line = rj.mask(line)
            if name == "stderr":
                rj.stderr_tail.append(line)
            if rj.detector.events == 0:  # no instrumentation speaking for it: its output is its sign of life
                rj.alive_at = time.time()
        rj.process.tail.append(line)
        if rj.advice is not None and rj.stack_lines is None:
            rj.advice.output(line)
        if rj.stack_lines is not None and name == "stderr":
            rj.stack_lines.append(line)
        elif rj.stack_lines is None:  # a stack dump we asked for is not the job's own output
            recovered = rj.detector.observe_output(time.time())  # movement only for a job with no other signal
            if recovered is not None:
                self.emit(rj, "alert", {"kind": AlertKind.STALLED, "message": recovered.message, "clear": True})
        self.emit(rj, "log", {"line": line[:8192], "stream": name})
        if rj.sourced is not None and rj.stack_lines is None:
            self.printed_metrics(rj, line)

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
                _, pending = await asyncio.wait(pending, timeout=5.0)
                for t in pending:
                    t.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await proc.release()  # its keeper killed what was left of its tree; its cgroup goes
        verdict = final_verdict(rj, keeper.returncode, self.name)
        close_alerts(rj, verdict, self.emit, disk_alert_open=self.disk.alert is not None)
        self.emit(rj, "state", verdict.model_dump(exclude_none=True))
        self.finish(rj.claim.job_id)

    def finish(self, job_id: int) -> None:
        rj = self.jobs.pop(job_id, None)
        if rj is not None and not rj.claim.node_rank and self.outbox.pending.get(job_id):
            self.delivering[job_id] = rj.alive_at
        self.done_jobs += 1
        self.finished_at = time.monotonic()
        self.flush_now.set()

    async def handle(self, commands: list[Command]) -> None:
        for c in commands:
            rj = self.jobs.get(c.job_id)
            if rj is None:
                continue
            action = c.action
            if action == Action.STACK and rj.claim.node_rank and rj.gang is not None:
                # node rank 0's agent asked: sent with the next heartbeat
                gangstacks.share(rj.gang, (await gangwatch.rank_stacks(rj.gang, rj.process.ranks()))[0])
            elif action == Action.STACK and rj.gang is not None and rj.claim.spec.nnodes > 1:
                # waits on the other nodes: not in the heartbeat
                asyncio.create_task(self.diagnosis.log_gang_stacks(rj, rj.gang))
            elif action == Action.STACK:
                stack = (await gangwatch.stalled_message(rj.gang, rj.process.ranks()))[1] if rj.gang \
                    else await self.diagnosis.capture_stack(rj)
                self.emit(rj, "log", {"line": stack[:8000], "stream": "agent"})
            elif action == Action.PAUSE and rj.command is not None and not rj.pausable and rj.requested is None:
                # The server refuses such a pause (409); a job whose process has not said pausable in this
                # attempt is never sent SIGUSR2 (its default action kills).
                rj.requested = Requested.PAUSE_REFUSED
                refused = ("agent: pause requested, but this command has not said it can pause "
                           "(no Trainer instrumentation); it keeps running")
                self.emit(rj, "log", {"line": refused, "stream": "agent"})
            elif action in (Action.CANCEL, Action.PAUSE) and (rj.requested is None or (action, rj.requested) in (
                    (Action.CANCEL, Requested.PAUSE), (Action.CANCEL, Requested.PAUSE_REFUSED))):
                rj.requested = Requested(action)
                self.emit(rj, "log", {"line": f"agent: {action} requested", "stream": "agent"})
                if action == Action.CANCEL:
                    asyncio.create_task(rj.process.stop(signal.SIGTERM, self.grace_s))
                else:  # pause: the training process checkpoints and exits; give it time to save
                    asyncio.create_task(self.pause(rj))

    async def pause(self, rj: RunningJob) -> None:
        """SIGUSR2 asks the training process to checkpoint and exit paused. A process a moment old may
        not have its handler yet (SIGUSR2's default action kills), so wait for its first event (its
        handlers are installed right after its event pipe opens), however loaded the machine is."""
        while rj.claim.job_id in self.jobs and (rj.process.proc is None or (
                rj.alive_at <= rj.born and time.monotonic() - rj.started < 120 and rj.process.proc.returncode is None)):
            await asyncio.sleep(0.2)
        if rj.process.proc is not None and rj.requested == Requested.PAUSE:
            rj.asked_at = time.time()
            await rj.process.stop(signal.SIGUSR2, max(self.grace_s, 120))
