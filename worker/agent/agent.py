"""The agent: claims jobs from the server, runs each in a supervised training process, relays its
events, heartbeats, watches for stalls, and carries out commands (cancel, pause, stack).

It talks to the server only over HTTP, so it can run on any machine that reaches the server.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import httpx

from tokenpulse.protocol import (Action, AgentHello, AgentReply, AlertKind, Claim, Command, CommandSpec, Failure,
                                 Heartbeat, Registered, event_batch_body)
from worker.agent.channel import Channel
from worker.checkpoint_layout import checkpoint_step, checkpoints_root, is_step_dir, is_tmp_dir, step_from_name
from worker.agent.child import CommandProcess, Supervised, TrainingProcess, describe_exit
from worker.agent.disk import disk_words, low_space, probe_writable
from worker.agent import gangstacks, gangwatch
from worker.agent.ranks import diagnose
from worker.agent.headline import folded, gang_headline, stall_headline
from worker.agent.launch import Gang, command, free_port, is_distributed, launches_ranks, training_args
from worker.agent.outbox import Outbox
from worker.agent.output import LineFolder, Masker, last_traceback_frame
from worker.agent import sysmetrics
from worker.agent.advice import OWNED, Advisor
from worker.agent.slow import SlowDetector
from worker.agent.sysmetrics import gpu_info, read_schedstat
from tokenpulse.diagnosis.stall import ALIVE_CLAUSE, StallConfig, StallDetector, stuck_at
from worker.agent import tree
from worker.agent.tree import JobTree
from tokenpulse.diagnosis.stacks import (can_run_handlers, describe_state, find_py_spy, process_state,
                                  py_spy_dump)

log = logging.getLogger("tokenpulse.agent")


def describe_device() -> str:
    """What this agent trains on, without importing torch into the agent (nvidia-smi if present)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
            if out:
                return "cuda: " + "; ".join(line.strip() for line in out.splitlines())
        except (OSError, subprocess.TimeoutExpired):
            pass
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def pick_resume(recorded: Optional[str], roots: Optional[list[Path]] = None) -> tuple[Optional[Path], str]:
    """Where an attempt starts: the checkpoint the server recorded when it is complete here; else the
    newest complete one beside it that is not newer (a newer one's metrics may never have reached
    the server: resuming past them would leave a gap); else step 0. Never a half-written one, and
    never one outside `roots` (the directories this agent trusts to load checkpoints from)."""
    if not recorded:
        return None, "starting from step 0"
    path = Path(recorded)
    if roots is not None:
        real = path.resolve()
        if not any(real == r or r in real.parents for r in roots):
            return None, (f"checkpoint {recorded} is outside this agent's resume roots "
                          f"({', '.join(map(str, roots))}; add one with --resume-root): starting from step 0")
    step = checkpoint_step(path)
    if step is not None:
        return path, f"resuming from {path} (step {step})"
    limit = step_from_name(path)
    limit = -1 if limit is None else limit
    older = []
    if path.parent.is_dir():
        for p in path.parent.iterdir():
            st = checkpoint_step(p) if is_step_dir(p) else None
            if st is not None and st <= limit:
                older.append((st, p))
    if older:
        st, p = max(older)
        return p, f"checkpoint {recorded} is missing or incomplete here; resuming from {p} (step {st})"
    return None, f"checkpoint {recorded} is missing or incomplete here and none older is: starting from step 0"


def prune_own_checkpoints(out_dir: Path, resume: Optional[Path]) -> None:
    """Before an attempt, drop this job's checkpoints in our own output directory that are newer than
    where it resumes (all of them, from step 0) and half-written temp dirs: left there, a stale newer
    one would outrank the new run's checkpoints when only the newest K are kept."""
    root = checkpoints_root(out_dir)
    if not root.is_dir():
        return
    start = checkpoint_step(resume) if resume is not None else -1
    for p in root.iterdir():
        if resume is not None and p.resolve() == resume.resolve():
            continue
        if is_tmp_dir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif is_step_dir(p):
            st = checkpoint_step(p)
            if st is None or st > start:
                shutil.rmtree(p, ignore_errors=True)


def retry_after(r: httpx.Response) -> Optional[float]:
    """The server's Retry-After in seconds (bounded to a minute), when it sent one."""
    try:
        return min(max(float(r.headers["retry-after"]), 0.1), 60.0)
    except (KeyError, ValueError):
        return None


def is_anatomy(data: dict) -> bool:
    """A rank's step-anatomy metrics (tokenpulse/instrument/patch_torch.py): stored for every rank."""
    values = data.get("values")
    return isinstance(values, dict) and bool(values) and all(str(k).startswith("anatomy/") for k in values)


def detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail"))[:300]
    except ValueError:
        return r.text[:300]


# ---- command jobs ---------------------------------------------------------------------------------

# Inherited by a command job only when it names them in secret_env: tokenpulse's own variables (the
# agent's token among them) and anything whose name says it is a credential.
CREDENTIAL_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|ACCESS_KEY|PRIVATE_KEY|AUTH",
                             re.IGNORECASE)


def instrumentation_dir() -> Optional[str]:
    """The startup-hook directory that makes a command job's Python processes report (Trainer
    callback, tqdm/datasets progress, alive thread): put first on the job's PYTHONPATH."""
    from tokenpulse.instrument import hook_dir  # stdlib only: the agent stays torch-free (tested)
    return hook_dir()


def command_env(base: Mapping[str, str], spec: CommandSpec, job_id: int, resume: Optional[str],
                hooks: Optional[str]) -> dict[str, str]:
    """A command job's environment: the agent's own, less credentials and tokenpulse's variables;
    then the job's plain settings (env), the secrets it names (secret_env, from `base`), and what
    the agent tells it (job id, event pipe, checkpoint to resume from, the instrumentation hook)."""
    env = {k: v for k, v in base.items() if not k.startswith("TOKENPULSE_") and not CREDENTIAL_NAME.search(k)}
    env.setdefault("PYTHONUNBUFFERED", "1")  # output as it happens, not in 8 KiB bursts
    env.setdefault("PYTHONFAULTHANDLER", "1")
    # `python`, `torchrun`, `accelerate`, `trl` as installed beside the agent (the environment its
    # instrumentation imports from): a venv's bin is often not on the PATH of whoever started it.
    # A job that sets PATH in its env decides for itself.
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, *(p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir)])
    env.update(spec.env)
    env.update({name: base[name] for name in spec.secret_env if name in base})
    env["TOKENPULSE_JOB_ID"] = str(job_id)
    if resume:
        env["TOKENPULSE_RESUME_FROM"] = resume
    if hooks:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (hooks, env.get("PYTHONPATH")) if p)
    return env


def confined_cwd(raw: str, roots: list[str]) -> tuple[Path, Optional[str]]:
    """A command's working directory resolved now (symlinks followed) and, when the server has path
    roots, checked against them: (the resolved directory the command runs in, why it may not run
    or None). The submit checked it too, but a directory swapped for a symlink since then would
    otherwise take the command anywhere."""
    try:
        real = Path(os.path.realpath(raw))
    except (OSError, ValueError) as e:
        return Path(raw), f"working directory {raw} cannot be resolved: {e}; nothing was run"
    if roots:
        allowed = [Path(os.path.realpath(r)) for r in roots]
        if not any(real == r or r in real.parents for r in allowed):
            return real, (f"working directory {raw} resolves to {real}, outside the server's path roots "
                          f"({', '.join(map(str, allowed))}): refused, nothing was run")
    return real, None


def command_resume(recorded: Optional[str], roots: list[Path], cwd: Path) -> tuple[Optional[str], str]:
    """The checkpoint a command job continues from (TOKENPULSE_RESUME_FROM): the one the server
    recorded, when it exists here and lies under the agent's resume roots or the job's own working
    directory (a Trainer's output_dir): never a path a report could point anywhere."""
    if not recorded:
        return None, "starting from the beginning"
    real = Path(recorded).resolve()
    allowed = [*roots, cwd.resolve()]
    if not any(real == r or r in real.parents for r in allowed):
        return None, (f"checkpoint {recorded} is outside this agent's resume roots and the job's working "
                      f"directory: starting from the beginning")
    if not real.exists():
        return None, f"checkpoint {recorded} does not exist here: starting from the beginning"
    return str(real), f"resuming from {real} (TOKENPULSE_RESUME_FROM)"


@dataclass
class RunningJob:
    claim: Claim
    process: Supervised
    detector: StallDetector
    slow: Optional[SlowDetector] = None
    advice: Optional[Advisor] = None  # a command job's first-steps verdicts, each with its fix
    alive_at: float = field(default_factory=time.time)
    child_state: Optional[dict] = None
    requested: Optional[str] = None  # cancel or pause, once asked
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

    @property
    def command(self) -> Optional[CommandSpec]:
        return self.claim.spec if isinstance(self.claim.spec, CommandSpec) else None


class Agent:
    def __init__(self, server: str, token: str, work_dir: Path, name: Optional[str] = None,
                 capacity: int = 1, heartbeat_s: float = 2.0, flush_s: float = 0.25,
                 poll_s: float = 1.0, grace_s: float = 10.0, stall: Optional[StallConfig] = None,
                 resume_roots: Optional[list[Path]] = None, allow_commands: bool = False,
                 snapshot_s: float = 10.0, address: Optional[str] = None):
        # where the other agents of a multi-node job reach this one (its node may host the rendezvous)
        self.address = address or socket.gethostname()
        self.server = server.rstrip("/")
        # Checkpoints this agent will load (torch.load runs pickles): under these directories only,
        # so a path reported by another (possibly compromised) agent token cannot point it anywhere.
        # Default: beside its own work dir (agents of one `tokenpulse up` share that parent).
        self.resume_roots = [Path(p).resolve() for p in (resume_roots or [Path(work_dir).resolve().parent])]
        self.http = httpx.AsyncClient(base_url=self.server, timeout=30,
                                      headers={"Authorization": f"Bearer {token}"})
        self.work_dir = work_dir
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.capacity = capacity
        # Command jobs are code execution on this machine: taken only when the operator says so.
        self.allow_commands = allow_commands
        self.snapshot_s = snapshot_s  # a progress bar redrawing without a newline: one log line per this
        self.heartbeat_s, self.flush_s, self.poll_s, self.grace_s = heartbeat_s, flush_s, poll_s, grace_s
        self.stall_config = stall or StallConfig.from_env()  # TOKENPULSE_STALL_* over the defaults
        self.gpu, self.gpu_bf16 = gpu_info()
        self.outbox = Outbox(work_dir / "journal")
        self.jobs: dict[int, RunningJob] = {}
        # Jobs whose process has ended but whose events (the final state among them) the server has not
        # all acknowledged: they stay in heartbeats (job -> its last alive time) until it has, so a
        # backlog longer than a lease never makes the server take a finished job for a lost one.
        self.delivering: dict[int, float] = {}
        self.agent_id: Optional[int] = None
        self.flush_now = asyncio.Event()
        self.beat_now = asyncio.Event()  # a nudge: heartbeat at once (its answer carries the command)
        self.beat_at = 0.0  # monotonic time of the last heartbeat the server answered (alone or folded)
        # One websocket for heartbeats and event batches (HTTP whenever it is down): channel.py
        self.channel = Channel(self.server, token, lambda: self.agent_id, self.beat_now.set)
        self.stopping = False
        self.stopped = asyncio.Event()  # set with stopping, to wake waits that should end
        self.unreachable_since: Optional[float] = None  # the server has not answered since then
        self.disk_error: Optional[str] = None  # the work dir could not be written (a full disk)
        self.disk_alert: Optional[str] = None  # the disk problem the jobs' alerts name
        self.disk_probe_at = 0.0  # monotonic time of the next probe while the disk is full
        self.done_jobs = 0
        self.host: Optional[sysmetrics.Host] = None  # the machine's readings (system_loop)
        self.gpus: Optional[sysmetrics.Gpus] = None

    # ---- server calls, each retried until the server answers (it may be restarting) ----------

    async def call(self, method: str, path: str, until_stopped: bool = False, **kw) -> Optional[httpx.Response]:
        """until_stopped: give up (None) once the agent is stopping: a claim must not keep a stopping
        agent alive while the server is down."""
        delay = 0.5
        while True:
            try:
                r = await self.http.request(method, path, **kw)
                self.unreachable_since = None
                if r.status_code < 500:
                    return r
                wait = retry_after(r)
                if wait is not None:  # 503 (database locked) / 507 (its disk full): it says when to retry
                    log.warning("%s %s: server answered %s (%s); retrying in %.0f s", method, path,
                                r.status_code, detail(r), wait)
                    delay = wait
                else:
                    log.warning("%s %s: server answered %s", method, path, r.status_code)
            except httpx.HTTPError as e:
                self.unreachable_since = self.unreachable_since or time.monotonic()
                log.warning("%s %s: %s; retrying", method, path, e)
            if until_stopped:
                try:
                    await asyncio.wait_for(self.stopped.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                if self.stopping:
                    return None
            else:
                await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def register(self) -> None:
        host = socket.gethostname()
        hello = AgentHello(name=self.name, host=host, device=describe_device(), capacity=self.capacity,
                           accepts_commands=self.allow_commands,
                           instance=hashlib.sha256(f"{host}:{self.work_dir.resolve()}".encode()).hexdigest()[:32])
        r = await self.call("POST", "/api/agents", json=hello.model_dump(), until_stopped=True)
        if r is None:
            return  # stopped before the server ever answered
        if r.status_code in (401, 403):  # a token that may not do this will never may: say why and stop
            raise SystemExit(f"the server refused to register this agent ({r.status_code}): "
                             f"{r.json().get('detail', r.text) if r.headers.get('content-type', '').startswith('application/json') else r.text}")
        r.raise_for_status()
        self.agent_id = Registered.model_validate(r.json()).id
        log.info("registered as agent %s (%s)%s", self.agent_id, self.name,
                 "; takes command jobs (--allow-commands)" if self.allow_commands else "")

    # ---- main loop -----------------------------------------------------------------------------

    async def run(self, max_jobs: Optional[int] = None, until_idle: bool = False) -> None:
        """Claim and run jobs until stopped (or after max_jobs, or when the queue is empty)."""
        self.outbox.recover()
        await asyncio.get_running_loop().run_in_executor(None, tree.sweep)  # trees of agents killed here
        await self.register()
        if self.agent_id is None:
            await self.http.aclose()
            return
        loops = [asyncio.create_task(self.heartbeat_loop()), asyncio.create_task(self.flush_loop()),
                 asyncio.create_task(self.channel.run()), asyncio.create_task(self.system_loop())]
        try:
            while not self.stopping:
                if max_jobs is not None and self.done_jobs + len(self.jobs) >= max_jobs:
                    if not self.jobs:
                        break
                elif len(self.jobs) < self.capacity and not self.disk_blocked():
                    # the offer: where this node would host a multi-node job's rendezvous
                    offer = {"endpoint": f"{self.address}:{free_port('')}"}
                    r = await self.call("POST", f"/api/agents/{self.agent_id}/claim", json=offer, until_stopped=True)
                    if r is None:
                        break
                    if r.status_code == 200:
                        await self.start_job(Claim.model_validate(r.json()))
                        continue
                    if r.status_code == 202:  # gathering a multi-node job's gang: ask again soon
                        await asyncio.sleep(min(self.poll_s, 0.5))
                        continue
                    if r.status_code == 404:  # the server forgot us (new database): register again
                        await self.register()
                        continue
                    if r.status_code in (401, 403):  # revoked or wrong token: say so, keep trying slowly
                        log.error("claim refused (%s): %s", r.status_code, r.text[:300])
                        await asyncio.sleep(max(self.poll_s, 5.0))
                        continue
                    if until_idle and not self.jobs:
                        break
                await asyncio.sleep(self.poll_s)
            while self.jobs:
                await asyncio.sleep(0.2)
            await self.drain()
        finally:
            for t in loops:
                t.cancel()
            await self.http.aclose()

    async def drain(self, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while self.outbox.size() and time.monotonic() < end:
            if self.unreachable_since is not None and time.monotonic() - self.unreachable_since > 3:
                # the journal keeps them: the next start of this agent sends them
                log.warning("server unreachable: %s events stay in the journal", self.outbox.size())
                return
            self.flush_now.set()
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        """Stop claiming. What runs is not the operator's to cancel: each job checkpoints (as for a
        pause) and goes back to the queue, to resume from that checkpoint here later or elsewhere."""
        self.stopping = True
        self.stopped.set()
        for rj in self.jobs.values():
            if rj.requested in (None, "pause-refused"):
                rj.requested = "shutdown"
                how = ("checkpointing to requeue" if rj.command is None or rj.pausable else
                       "stopping the command (it cannot checkpoint) to requeue it")
                self.emit(rj, "log", {"line": f"agent {self.name} stopping: {how}", "stream": "agent"})
        # SIGUSR2: checkpoint and exit paused. A command job that never said it can (pausable) would
        # die of SIGUSR2's default action: it gets SIGTERM, and the retry policy requeues it.
        await asyncio.gather(*(rj.process.stop(signal.SIGUSR2 if rj.requested == "shutdown" and (
            rj.command is None or rj.pausable) else signal.SIGTERM, max(self.grace_s, 60))
            for rj in self.jobs.values()), return_exceptions=True)

    # ---- one job -------------------------------------------------------------------------------

    async def start_job(self, claim: Claim) -> None:
        job_dir = self.work_dir / "jobs" / str(claim.job_id)
        if isinstance(claim.spec, CommandSpec):
            return await self.start_command(claim, job_dir)
        spec_path = job_dir / "spec.json"
        self.outbox.open_job(claim.job_id, claim.seq_start)
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            spec_path.write_text(claim.spec.model_dump_json(indent=2))
        except OSError as e:  # a full disk: the job is not ours to fail; back to the queue, no retry spent
            self.disk_error = disk_words(self.work_dir, e)
            log.error("job %s: %s; requeued, and no claims until it can be written", claim.job_id, self.disk_error)
            self.outbox.add(claim.job_id, "state", {"state": "queued", "reason": f"agent {self.name}: "
                                                    f"{self.disk_error}; requeued"})
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
        rj = RunningJob(claim=claim, process=proc, detector=StallDetector(stall),
                        slow=SlowDetector(stall, gpu=self.gpu, gpu_bf16=self.gpu_bf16),
                        gang=gangwatch.GangState() if fifo else None)
        self.jobs[claim.job_id] = rj
        self.emit(rj, "log", {"line": f"agent {self.name}: attempt {claim.attempt}: {resume_note}", "stream": "agent"})
        try:
            await proc.start()
        except OSError as e:
            self.emit(rj, "state", {"state": "failed", "reason": f"could not start training: {e}", "failure": Failure.CRASH})
            self.finish(claim.job_id)
            return
        self.watch(rj)

    async def start_command(self, claim: Claim, job_dir: Path) -> None:
        """A command job: the command as given, in its working directory, with its environment, the
        event pipe and (unless instrument is off) the instrumentation hook on its PYTHONPATH."""
        spec: CommandSpec = claim.spec
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
        stall = self.stall_config.merged(spec.stall.model_dump())
        rj = RunningJob(claim=claim, process=proc, detector=StallDetector(stall),
                        slow=SlowDetector(stall, gpu=self.gpu, gpu_bf16=self.gpu_bf16), cwd=cwd,
                        gang=gangwatch.GangState() if launcher else None,
                        mask=mask)
        rj.advice = Advisor(stall, gpu=self.gpu, gpu_bf16=self.gpu_bf16)
        rj.slow.owned = OWNED  # padding and step size: judged by the advisor, with the script's own fix
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
            self.emit(rj, "state", {"state": "failed", "reason": problem, "failure": Failure.SPEC})
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
        rj.sys = sysmetrics.TreeSampler(proc.proc.pid)  # the whole tree, from now on (not its first output)
        rj.tasks = [asyncio.create_task(self.read_events(rj)),
                    asyncio.create_task(self.read_output(rj, proc.proc.stdout, "stdout")),
                    asyncio.create_task(self.read_output(rj, proc.proc.stderr, "stderr")),
                    asyncio.create_task(self.supervise(rj))]

    def disk_blocked(self) -> bool:
        """No claims while this agent's work dir is full or cannot be written: a job would fail for
        want of space, and a command job with a cwd of its own would run without its journal."""
        return self.check_disk() is not None

    def check_disk(self) -> Optional[str]:
        """Why the work dir cannot take a job now, or None. A problem holds until a probe write
        succeeds with space to spare: the journal rewriting an empty file is not space returning."""
        if self.disk_error is None:
            self.disk_error = self.outbox.disk_error or low_space(self.work_dir)
            if self.disk_error is not None:
                log.error("%s: no claims until space returns", self.disk_error)
        elif time.monotonic() >= self.disk_probe_at:
            self.disk_probe_at = time.monotonic() + 1.0  # a 64 KiB write and fsync, at most each second
            if self.outbox.disk_error is None and low_space(self.work_dir) is None and probe_writable(self.work_dir):
                log.warning("work dir %s is writable again: claiming jobs", self.work_dir)
                self.disk_error = None
        return self.disk_error

    def watch_disk(self) -> None:
        """Name a full disk on every job this agent runs (an alert), and say when it is over."""
        problem = self.check_disk()
        if problem and self.disk_alert is None:
            self.disk_alert = problem
            for rj in self.jobs.values():
                self.emit(rj, "alert", {"kind": AlertKind.DISK_FULL, "severity": "critical", "message": (
                    f"agent {self.name}: {problem}; its events are kept in memory and still sent, "
                    "and it claims no new job until space returns")})
        elif not problem and self.disk_alert is not None:
            self.disk_alert = None
            for rj in self.jobs.values():
                self.emit(rj, "alert", {"kind": AlertKind.DISK_FULL, "clear": True,
                                        "message": f"agent {self.name}: its disk is writable again"})

    def emit(self, rj: RunningJob, kind: str, data: dict, t: Optional[float] = None) -> None:
        if rj.claim.node_rank:  # a multi-node job's other nodes: node rank 0's agent tells the story
            if kind in ("state", "alert") or kind == "log" and data.get("stream") == "agent":
                log.info("job %s (node %s): %s %s", rj.claim.job_id, rj.claim.node_rank, kind, str(data)[:500])
            return
        self.outbox.add(rj.claim.job_id, kind, data, t)
        if kind in ("state", "alert", "phase"):
            self.flush_now.set()

    async def read_events(self, rj: RunningJob) -> None:
        reader = rj.process.events
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
                        self.emit(rj, kind, {**data, "message": f"rank {rank}: {data.get('message', '')}"[:8192]}, t)
                    elif kind == "info":
                        self.emit(rj, kind, data, t)
                    elif kind == "state" and rj.claim.node_rank and rj.child_state is None:
                        rj.child_state = data  # another node's end is judged by its own ranks' word
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
                data = self.masked(rj, kind, data)
                if kind == "info" and data.get("pausable") is not None:
                    # The instrumentation's promise (a Trainer callback) that SIGUSR2 makes the process
                    # save a checkpoint and exit paused; without it a command job is never sent SIGUSR2.
                    rj.pausable = bool(data["pausable"])
            if kind == "state":
                rj.child_state = data  # judged together with the exit code, in supervise()
                continue
            self.emit(rj, kind, data, t)

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

    async def supervise(self, rj: RunningJob) -> None:
        """Watch for stalls and slowness while the process runs; then report how it ended."""
        proc = rj.process
        while proc.proc.returncode is None:
            try:
                await asyncio.wait_for(proc.proc.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
            if proc.proc.returncode is not None:
                break
            if rj.gang is not None:
                self.watch_gang(rj)
            try:
                await self.detect(rj, time.time())
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
        verdict = self.judge_exit(rj, proc.proc.returncode)
        if rj.gang is not None and rj.requested is None:
            verdict = gangwatch.judge(rj.gang, verdict, list(proc.tail))
        if rj.gang is not None:
            verdict["ranks"] = gangwatch.exits(rj.gang, list(proc.tail))
        if verdict.get("state") == "failed" and verdict.get("failure") in (Failure.CRASH, Failure.SIGNAL):
            d = rj.detector
            ago = time.time() - d.last_progress if d.last_progress else 0
            verdict["reason"] = (f"{verdict.get('reason') or ''}\nlast progress: {d.where()}, "
                                 f"{ago:.0f} s before the exit")[-8000:]
        self.close_alerts(rj, verdict)
        self.emit(rj, "state", verdict)
        self.finish(rj.claim.job_id)

    def watch_gang(self, rj: RunningJob) -> None:
        """A rank that ended without finishing takes the whole gang down within seconds."""
        g, now = rj.gang, time.time()
        pids = rj.process.ranks()
        gangwatch.identify(g, pids, now)  # ranks that have not said who they are (a command's)
        line = gangwatch.watch_deaths(g, pids, now)
        if line is not None:
            self.emit(rj, "log", {"line": f"agent: {line}", "stream": "agent"})
        if g.down_at is not None and not g.killed and now - g.down_at >= gangwatch.DEATH_GRACE_S:
            g.killed = True
            rj.process.kill_all()
        g.board.open_s, g.board.clear_s = rj.detector.config.alert_open_s, rj.detector.config.alert_clear_s
        v = g.board.check_straggler(now=now)
        if v is not None:
            kind, message = v
            self.emit(rj, "alert", {"kind": AlertKind.STRAGGLER, "severity": "warning", "message": message,
                                    "clear": kind.endswith("_clear")})

    async def detect(self, rj: RunningJob, now: float) -> None:
        # A command that reports nothing (not instrumented, not Python) is judged by its output lines.
        v = rj.detector.check(now)
        if v is not None:
            rj.stall_clear = None  # stalled again before its clear was due: the open alert goes on
        elif rj.stall_clear is not None and now - rj.stall_clear[0] >= rj.detector.config.alert_clear_s:
            self.emit(rj, "alert", {"kind": AlertKind.STALLED, "message": rj.stall_clear[1], "clear": True})
            rj.stall_clear = None
        if v is not None and v.kind == AlertKind.STALLED and rj.gang is not None and rj.claim.node_rank:
            pass  # another node's share: node rank 0's agent judges the gang, asking for these stacks
        elif v is not None and v.kind == AlertKind.STALLED and rj.gang is not None:
            where, stack, stacks = await self.gang_verdict(rj)
            if rj.process.proc.returncode is None:
                head, odd_stack = gang_headline(v.silent_s, stacks, rj.detector.where())
                message = folded(head, f"{v.message}; {where}", odd_stack)
                self.emit(rj, "alert", {"kind": AlertKind.STALLED, "severity": "critical",
                                        "message": message[:8192], "stack": stack[-199_000:]})
        elif v is not None and v.kind == AlertKind.STALLED:
            stack = await self.capture_stack(rj)
            if rj.process.proc.returncode is not None:
                return  # it ended while we looked: the exit tells the story
            where = stuck_at(stack)
            state = process_state(rj.process.pid)
            message = v.message
            if not can_run_handlers(state):  # its alive thread spoke a moment ago, but it is frozen now
                message = message.replace(ALIVE_CLAUSE, "") + f"; process state {describe_state(state)}"
            message += f"; stuck at {where}" if where else ""
            message = folded(stall_headline(v.silent_s, stack, rj.detector.where()), message, stack)
            self.emit(rj, "alert", {"kind": AlertKind.STALLED, "severity": "critical", "message": message,
                                    "stack": stack[-199_000:] if stack else None})
        if rj.advice is not None:
            await self.advise(rj, now)
        if rj.slow is None:
            return
        sched = read_schedstat(rj.process.pid)  # CPU time vs waiting for a CPU: tells a busy machine
        if sched is not None:
            rj.slow.observe_sched(now, *sched)
        if rj.slow.fresh:
            rj.slow.observe_load(os.getloadavg()[0], os.cpu_count())
        for v in (rj.slow.check(now), rj.slow.check_contention(now)):
            if v is None:
                continue
            kind, clear = v.kind.removesuffix("_clear"), v.kind.endswith("_clear")
            severity = "info" if kind == AlertKind.CONTENTION else "warning"
            self.emit(rj, "alert", {"kind": kind, "severity": severity, "message": v.message, "clear": clear})

    async def advise(self, rj: RunningJob, now: float) -> None:
        """A command job's verdicts on its first steps (worker/agent/advice.py), and the 'quiet'
        warning: a finished phase and nothing since, with where the main thread waits."""
        for kind, message in rj.advice.check():
            self.emit(rj, "alert", {"kind": kind, "severity": "warning", "message": message[:8192]})
        head = rj.advice.quiet_due(rj.detector, now)
        if head is not None:
            stack = await self.capture_stack(rj)
            if rj.process.proc.returncode is None and rj.detector.last_progress is not None \
                    and now - rj.detector.last_progress >= 0 and not rj.detector.stalled:
                self.emit(rj, "alert", {"kind": AlertKind.QUIET, "severity": "warning",
                                        "message": rj.advice.quiet_message(head, stack)[:8192],
                                        "stack": stack[-199_000:] if stack else None})
        line = rj.advice.quiet_phase(now)
        if line is not None:  # a finished phase is never the job's status: the phase line says it is quiet
            self.emit(rj, "phase", line)

    async def gang_verdict(self, rj: RunningJob) -> tuple[str, str, dict]:
        """The stuck rank named across the gang: this node's stacks, and on a multi-node job every
        other node's, as their agents sent them (worker/agent/gangstacks.py). (verdict, every rank's
        stacks as one text, rank -> its stack)."""
        stacks, text = await gangwatch.rank_stacks(rj.gang, rj.process.ranks())
        spec = rj.claim.spec
        if getattr(spec, "nnodes", 1) <= 1:
            return diagnose(stacks, rj.gang.board), text, stacks

        path = f"/api/agents/{self.agent_id}/jobs/{rj.claim.job_id}/stacks"
        await self.call("POST", path)  # the other nodes' agents read theirs on their next heartbeat

        async def fetch():
            r = await self.call("GET", path)
            return r.json() if r is not None and r.status_code == 200 else None
        remote = await gangstacks.gather(fetch, stacks, spec.nnodes * spec.nproc_per_node)
        stacks, text, board = gangstacks.merged(rj.gang, stacks, text, remote)
        return diagnose(stacks, board), text, stacks

    async def log_gang_stacks(self, rj: RunningJob) -> None:
        """A person's stack request on a multi-node job: the merged verdict and every node's stacks."""
        where, stack, _ = await self.gang_verdict(rj)
        self.emit(rj, "log", {"line": f"{where}\n{stack}"[:8000], "stream": "agent"})

    def close_alerts(self, rj: RunningJob, verdict: dict) -> None:
        """The process is gone: open stalled/slow alerts close (saying how it ended); a crash alerts."""
        how = f"the {'command' if rj.command is not None else 'training process'} ended ({verdict.get('state')})"
        if self.disk_alert is not None:
            self.emit(rj, "alert", {"kind": AlertKind.DISK_FULL, "message": how, "clear": True})
        if rj.detector.stalled or rj.stall_clear is not None:
            self.emit(rj, "alert", {"kind": AlertKind.STALLED, "message": how, "clear": True})
        if rj.gang is not None and rj.gang.board.straggler is not None:
            self.emit(rj, "alert", {"kind": AlertKind.STRAGGLER, "message": how, "clear": True})
        if rj.slow is not None and rj.slow.open_keys:
            self.emit(rj, "alert", {"kind": AlertKind.SLOW, "message": how, "clear": True})
        if rj.advice is not None:
            for kind in list(rj.advice.open) + ([AlertKind.QUIET] if rj.advice.quiet_open else []):
                self.emit(rj, "alert", {"kind": kind, "message": how, "clear": True})
        if rj.slow is not None and rj.slow.contention_open:
            self.emit(rj, "alert", {"kind": AlertKind.CONTENTION, "message": how, "clear": True})
        if verdict.get("state") == "failed" and verdict.get("failure") in (Failure.CRASH, Failure.SIGNAL, Failure.ERROR):
            # the root cause alone: the traceback and the last output are shown once, in the job's
            # reason (and its log), not a second time in the alert
            head, _, rest = (verdict.get("reason") or "training process crashed").partition("\n")
            head = head.split("; last output:")[0]
            more = " (traceback and last output in the job's reason)" if rest or "; last output:" in (verdict.get("reason") or "") else ""
            self.emit(rj, "alert", {"kind": AlertKind.CRASHED, "severity": "critical", "message": (head + more)[:8000]})

    def judge_exit(self, rj: RunningJob, returncode: int) -> dict:
        code, sig, words = describe_exit(returncode)
        child = rj.child_state or {}
        said = child.get("state")
        what = "command" if rj.command is not None else "training process"
        if rj.requested == "shutdown" and said == "paused":  # checkpointed on the way out: requeue,
            return {"state": "queued", "exit_code": code,   # no retry spent
                    "reason": f"agent {self.name} shut down; requeued ({child.get('reason', 'checkpoint saved')})"}
        if rj.requested == "shutdown" and said is None:
            return {"state": "failed", "failure": Failure.LOST, "exit_code": code, "signal": sig, "retry": True,
                    "reason": f"agent {self.name} shut down; {what} {words}"}
        if returncode == 0 and said in ("completed", "paused", "cancelled"):
            return {**child, "exit_code": 0}
        if rj.requested == Action.CANCEL:
            return {"state": "cancelled", "reason": f"cancelled by user; {what} {words}",
                    "exit_code": code, "signal": sig}
        tail = "\n".join(list(rj.process.tail)[-15:])
        if rj.command is not None and not child.get("failure"):
            # A command is judged by its exit: 0 is success; another code is a failure of the script
            # (not retried: it would fail the same way), named by its traceback's innermost frame; a
            # signal (killed, crashed) goes to the retry policy below.
            if returncode == 0:
                return {"state": "completed", "exit_code": 0}
            if sig is None:
                frame = last_traceback_frame(list(rj.stderr_tail), str(rj.cwd) if rj.cwd else None)
                reason = f"{frame}\n" if frame else ""
                reason += f"command {words}" + (f"; last output:\n{tail}" if tail else "")
                return {"state": "failed", "reason": reason[:8000],
                        "failure": Failure.ERROR, "exit_code": code, "retry": False}
        failure = child.get("failure") or (Failure.SIGNAL if sig else Failure.CRASH)
        reason = child.get("reason") or f"{what} {words}"
        if tail and not child.get("reason"):
            reason += f"; last output:\n{tail}"
        return {"state": "failed", "reason": reason, "failure": failure, "exit_code": code, "signal": sig,
                "retry": failure in (Failure.OOM, Failure.CRASH, Failure.SIGNAL)}

    def finish(self, job_id: int) -> None:
        rj = self.jobs.pop(job_id, None)
        if rj is not None and not rj.claim.node_rank and self.outbox.pending.get(job_id):
            self.delivering[job_id] = rj.alive_at
        self.done_jobs += 1
        self.flush_now.set()

    async def capture_stack(self, rj: RunningJob) -> str:
        """Every thread's Python stack. In order: py-spy (suspends the process for a consistent
        read); py-spy --nonblocking (reads a process that cannot be suspended: already stopped, or
        traced); faulthandler by SIGUSR1 (needs the process to run its own handler, so only when it
        can). TOKENPULSE_STACK_TOOL=faulthandler tries faulthandler first; py-spy --nonblocking is
        still the fallback when the process could not answer (frozen: an empty dump names nothing)."""
        pid = rj.process.pid
        state = process_state(pid)
        spy = find_py_spy()
        notes = [f"process {pid} state: {describe_state(state)}"]
        subprocesses = rj.command is not None  # a command may be a shell or launcher; its Python runs below it
        # py-spy's suspending dump waits for the process to stop: one in uninterruptible I/O never
        # does (it would cost the whole timeout), one already stopped makes it fail at once
        if spy and can_run_handlers(state) and os.environ.get("TOKENPULSE_STACK_TOOL", "py-spy") != "faulthandler":
            out, why = await py_spy_dump(spy, pid, nonblocking=False, subprocesses=subprocesses)
            if out:
                return "py-spy dump:\n" + out
            notes.append(f"py-spy: {why}")
        if can_run_handlers(state) and rj.detector.events:
            lines = await self.faulthandler_dump(rj)
            if any(x.lstrip().startswith("File ") for x in lines):
                return "faulthandler dump:\n" + "\n".join(lines)
            notes.append("faulthandler: the process wrote no stack (it could not run its handler)")
        elif not rj.detector.events:  # before its first event its SIGUSR1 handler may not exist yet
            # (a command job has the handler once its instrumentation speaks: an uninstrumented one never)
            notes.append("faulthandler: not asked (the " + ("command reports no events (not instrumented)"
                         if rj.command is not None else "process has not started reporting yet") + ")")
        else:
            notes.append("faulthandler: not asked (a stopped or I/O-blocked process cannot run it)")
        if spy:
            out, why = await py_spy_dump(spy, pid, nonblocking=True, subprocesses=subprocesses)
            if out:
                return f"py-spy dump (--nonblocking; {'; '.join(notes)}):\n" + out
            notes.append(f"py-spy --nonblocking: {why}")
        else:
            notes.append("py-spy is not installed")
        log.info("job %s: no stack: %s", rj.claim.job_id, "; ".join(notes))
        return "no stack: " + "; ".join(notes)

    async def faulthandler_dump(self, rj: RunningJob) -> list[str]:
        """faulthandler writes every thread's stack to stderr; read_output collects the lines."""
        rj.stack_lines = []
        rj.process.signal(signal.SIGUSR1)
        end, seen, quiet_since = time.monotonic() + 3.0, 0, time.monotonic()
        while time.monotonic() < end:
            await asyncio.sleep(0.1)
            if len(rj.stack_lines) != seen:
                seen, quiet_since = len(rj.stack_lines), time.monotonic()
            elif seen and time.monotonic() - quiet_since > 0.3 and any(
                    x.startswith(("Current thread", "Thread 0x")) for x in rj.stack_lines):
                break  # the dump is complete: lines stopped arriving
        lines, rj.stack_lines = rj.stack_lines, None
        return lines

    # ---- commands from the server --------------------------------------------------------------

    async def handle(self, commands: list[Command]) -> None:
        for c in commands:
            rj = self.jobs.get(c.job_id)
            if rj is None:
                continue
            action = c.action
            if action == Action.STACK and rj.claim.node_rank:  # node rank 0's agent asked: sent next heartbeat
                gangstacks.share(rj.gang, (await gangwatch.rank_stacks(rj.gang, rj.process.ranks()))[0])
            elif action == Action.STACK and rj.gang is not None and getattr(rj.claim.spec, "nnodes", 1) > 1:
                asyncio.create_task(self.log_gang_stacks(rj))  # waits on the other nodes: not in the heartbeat
            elif action == Action.STACK:
                stack = (await gangwatch.stalled_message(rj.gang, rj.process.ranks()))[1] if rj.gang \
                    else await self.capture_stack(rj)
                self.emit(rj, "log", {"line": stack[:8000], "stream": "agent"})
            elif action == Action.PAUSE and rj.command is not None and not rj.pausable and rj.requested is None:
                # The server refuses such a pause (409); a job whose process has not said pausable in this
                # attempt is never sent SIGUSR2 (its default action kills).
                rj.requested = "pause-refused"
                self.emit(rj, "log", {"line": "agent: pause requested, but this command has not said it can "
                                              "pause (no Trainer instrumentation); it keeps running", "stream": "agent"})
            elif action in (Action.CANCEL, Action.PAUSE) and (rj.requested is None or (action, rj.requested) in (
                    (Action.CANCEL, Action.PAUSE), (Action.CANCEL, "pause-refused"))):
                rj.requested = action
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
        if rj.process.proc is not None and rj.requested == Action.PAUSE:
            await rj.process.stop(signal.SIGUSR2, max(self.grace_s, 120))

    def alive_jobs(self) -> dict[str, float]:
        """What a heartbeat says: each job and when its process last said it was alive."""
        beat = {str(jid): at for jid, at in self.delivering.items()}
        beat.update({str(jid): rj.alive_at for jid, rj in self.jobs.items() if not rj.claim.node_rank})
        return beat

    async def heartbeat_loop(self) -> None:
        tried_at = 0.0
        while True:
            nudged = self.beat_now.is_set()
            self.beat_now.clear()
            try:
                # A heartbeat folded into an event batch (send) counts: then none is due here.
                if nudged or time.monotonic() - self.beat_at >= self.heartbeat_s * 0.9:
                    tried_at = time.monotonic()
                    # a multi-node job's share on node rank > 0 is node rank 0's agent's job on the server:
                    # only its ranks are reported (a cancel reaches them through rank 0: they agree on it)
                    beat = Heartbeat(jobs=self.alive_jobs(),
                                     ranks={jid: rj.mask.data(rj.gang.board.rows()) for jid, rj in self.jobs.items()
                                            if rj.gang is not None and rj.gang.board.ranks})  # the rank table
                    for rj in self.jobs.values():
                        if rj.gang is not None:
                            gangstacks.sent(rj.gang)  # asked-for stacks go once
                    reply = None
                    if not beat.ranks:  # rank tables go over HTTP (the socket carries job liveness only)
                        reply = await self.channel.request({"heartbeat": self.alive_jobs()})
                    if reply is None or "status" in reply:
                        r = await self.call("POST", f"/api/agents/{self.agent_id}/heartbeat",
                                            json=beat.model_dump(exclude_none=True))
                        reply = r.json() if r.status_code == 200 else None
                    if reply is not None:
                        self.beat_at = time.monotonic()
                        await self.handle(AgentReply.model_validate(reply).commands)
            except Exception:
                log.exception("heartbeat failed")
            try:
                due_in = max(self.beat_at, tried_at) + self.heartbeat_s - time.monotonic()  # refused: not sooner
                await asyncio.wait_for(self.beat_now.wait(), max(0.05, due_in))
            except asyncio.TimeoutError:
                pass

    async def system_loop(self) -> None:
        """System metrics (sysmetrics.py): each job's process tree a second after it starts, then every
        5 s, as sys/ metric events; the machine every 5 s to the server (the workers page)."""
        loop = asyncio.get_running_loop()
        posted = 0.0
        while not self.stopping:
            try:
                now = time.monotonic()
                due = [rj for rj in list(self.jobs.values()) if rj.sys is not None and rj.sys.due(now)]
                machine_due = now - posted >= sysmetrics.EVERY_S and self.agent_id is not None
                if due or machine_due:
                    samples, summary = await loop.run_in_executor(None, self.read_system, due, now)
                    t = time.time()
                    for rj, values, gpu_util in samples:
                        if rj.process.proc is None or rj.process.proc.returncode is not None:
                            continue  # it ended while we read: its last sample says nothing
                        self.emit(rj, "metrics", {"step": int(t), "values": values}, t)
                        if rj.slow is not None and isinstance(values.get("sys/rss_mb"), (int, float)):
                            rj.slow.observe_memory(t, values["sys/rss_mb"], rj.detector.step)  # memory blow-up
                        if gpu_util is not None and rj.slow is not None:
                            rj.slow.observe_gpu(t, gpu_util)
                    if machine_due:
                        posted = now
                        try:
                            await self.http.post(f"/api/agents/{self.agent_id}/system", json=summary, timeout=5)
                        except httpx.HTTPError:
                            pass  # a live reading: the next one replaces it
            except Exception:  # system metrics must never take the agent down
                log.exception("system metrics failed")
            try:
                await asyncio.wait_for(self.stopped.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    def read_system(self, due: list, now: float) -> tuple[list, dict]:
        """(job, sys/ values, its GPUs' utilisation) per due job, and the machine's summary (a thread)."""
        if self.host is None:
            self.host, self.gpus = sysmetrics.Host(), sysmetrics.Gpus()
        gpus = self.gpus.read()
        host = self.host.read(now)
        out = []
        for rj in due:
            values = rj.sys.sample(now, host, gpus)
            out.append((rj, values, sysmetrics.job_gpu_util(gpus, rj.sys.pids)))
        return out, self.host.summary(gpus)

    async def take_reply(self, data: dict) -> None:
        """The server's answer to an event batch (socket or HTTP): drop what it stored, act on commands."""
        reply = AgentReply.model_validate(data)
        self.outbox.ack(reply.acked)
        await self.handle(reply.commands)

    async def send(self, batch: list[dict]) -> bool:
        """POST one batch; True once the server answered it. A batch the server refuses as malformed
        (422) or too large (413) is split in halves until the culprit is one event, which is dropped
        with a log line: one bad event must never hold back every event after it."""
        body = event_batch_body(batch)
        if len(batch) < 1000:  # small batches over the websocket; a refusal is split over HTTP below
            msg: dict = dict(body)
            if time.monotonic() - self.beat_at >= self.heartbeat_s * 0.5 and not any(  # one message, not two
                    rj.gang is not None for rj in self.jobs.values()):  # (rank tables: heartbeat_loop, HTTP)
                msg["heartbeat"] = self.alive_jobs()
            got = await self.channel.request(msg)
            if got is not None and "status" not in got:
                if "heartbeat" in msg:
                    self.beat_at = time.monotonic()
                await self.take_reply(got)
                return True
        r = await self.call("POST", f"/api/agents/{self.agent_id}/events", json=body)
        if r.status_code == 200:
            await self.take_reply(r.json())
            return True
        if r.status_code in (413, 422):
            if len(batch) == 1:
                self.outbox.drop(batch[0], f"{r.status_code} {r.text}")
                return True
            half = len(batch) // 2
            return await self.send(batch[:half]) and await self.send(batch[half:])
        # 401/403 (a revoked token) or 404 (unknown agent): keep everything and try again later
        log.error("events refused (%s): %s", r.status_code, r.text[:500])
        return False

    async def flush_loop(self) -> None:
        """Send pending events in batches about every flush_s (at once for state changes/alerts)."""
        while True:
            try:
                await asyncio.wait_for(self.flush_now.wait(), self.flush_s)
            except asyncio.TimeoutError:
                pass
            self.flush_now.clear()
            try:
                self.outbox.retry_journal()
                self.watch_disk()
                while self.outbox.size():
                    batch = self.outbox.batch()
                    if not await self.send(batch):
                        await asyncio.sleep(1)
                        break
                    if len(batch) < 1000:  # a small batch: caught up; more in flush_s
                        break
                for job_id in list(self.outbox.pending):
                    if job_id not in self.jobs:
                        self.outbox.close_job(job_id)
                for job_id in list(self.delivering):
                    if not self.outbox.pending.get(job_id):  # all acknowledged: its end is the server's
                        del self.delivering[job_id]
            except Exception:
                log.exception("flush failed")
                await asyncio.sleep(1)
