"""One supervised process (tokenpulse's training process, or a command job's command): started in
its own session under its keeper (keeper.py: a subreaper, in the attempt's cgroup where there is
one, that kills the whole tree when the process ends or the agent dies), its event pipe and output
read, stopped gracefully (a signal, then SIGKILL of its whole tree after a grace period), its exit
judged."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import deque
from pathlib import Path
from typing import Optional

from tokenpulse.control import CANCEL_WORD, CONTROL_ENV  # read by worker/training/controls.py, the Trainer hook
from worker.agent.proc import children
from worker.agent.tree import JobTree


def describe_exit(returncode: int) -> tuple[Optional[int], Optional[str], str]:
    """(exit_code, signal name, words) for a process's return code."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (the kernel's OOM killer sends this too)" if name == "SIGKILL" else ""
        return None, name, f"killed by {name}{hint}"
    return returncode, None, f"exited with code {returncode}"


def read_line(fd: int) -> str:
    out = b""
    while not out.endswith(b"\n"):
        chunk = os.read(fd, 256)
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")


class Supervised:
    """What the agent holds of a process it runs: the process, its event pipe, its last output.

    A gang (torchrun and its ranks) gets its event pipe as a FIFO by path (`fifo`): torchrun closes
    inherited descriptors, and puts each rank in a session of its own."""

    def __init__(self, fifo: Optional[Path] = None, launcher: bool = False):
        self.proc: Optional[asyncio.subprocess.Process] = None
        self.events: Optional[asyncio.StreamReader] = None
        self.tail: deque[str] = deque(maxlen=40)  # last output lines, for the failure reason
        self.fifo = fifo
        self.launcher = launcher or fifo is not None  # torchrun: its children are the ranks
        self._hold_fd: Optional[int] = None
        # The attempt's tree (the agent names the job); the keeper is self.proc, the job's own
        # process (what is signalled, read by py-spy, judged) is main_pid.
        self.tree = JobTree(job=f"untracked-{os.getpid()}-{id(self)}", job_id=-1, attempt=0)
        self.main_pid: Optional[int] = None
        # The agent's word before its own SIGTERM (worker/training/controls.py, the Trainer hook): a
        # SIGTERM with "cancel" written here is the agent's cancel; any other comes from outside (a
        # preemption) and means "checkpoint and come back". Set by the job run, one per attempt.
        self.control_file: Optional[Path] = None

    def control_env(self, env: dict) -> dict:
        """The control file named in the job's environment, emptied for this attempt."""
        if self.control_file is None:
            return env
        try:
            self.control_file.parent.mkdir(parents=True, exist_ok=True)
            self.control_file.write_text("")
        except OSError:
            return env
        return {**env, CONTROL_ENV: str(self.control_file)}

    def announce_cancel(self) -> None:
        """Before the agent's SIGTERM: say it is a cancel (written before the signal, so every rank's
        handler reads it)."""
        if self.control_file is not None:
            try:
                self.control_file.write_text(CANCEL_WORD)
            except OSError:
                pass

    @property
    def gang(self) -> bool:
        return self.launcher

    @property
    def started(self) -> asyncio.subprocess.Process:
        """Its keeper's process, once start() made it: what is waited on and read."""
        if self.proc is None:
            raise RuntimeError("the process has not been started")
        return self.proc

    def output(self) -> tuple[asyncio.StreamReader, asyncio.StreamReader]:
        """Its stdout and stderr (_start_kept pipes both)."""
        out, err = self.started.stdout, self.started.stderr
        if out is None or err is None:
            raise RuntimeError("the process's output is not piped")
        return out, err

    def ranks(self) -> list[int]:
        """The ranks: torchrun's children for a gang, else the one process."""
        if self.proc is None:
            return []
        return children(self.pid) if self.gang else [self.pid]

    async def _start_kept(self, args: list[str], env: dict, cwd: Optional[Path],
                          pass_fds: tuple[int, ...] = ()) -> asyncio.subprocess.Process:
        """The keeper, starting args in a session of its own; returns once it said the pid (or why
        the command could not start: an OSError, as a direct start would raise)."""
        loop = asyncio.get_running_loop()
        if self.tree.job_id >= 0:  # no survivor of an earlier attempt; this attempt's cgroup
            await loop.run_in_executor(None, self.tree.prepare)
        pid_r, pid_w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.tree.keeper_args(pid_w, pass_fds), "--", *args, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd, pass_fds=(pid_w, *pass_fds),
                start_new_session=True, limit=1 << 20)
        except BaseException:
            os.close(pid_r)
            raise
        finally:
            os.close(pid_w)
        try:
            line = await loop.run_in_executor(None, read_line, pid_r)
        finally:
            os.close(pid_r)
        if not line.strip().isdigit():
            await proc.wait()
            await loop.run_in_executor(None, self.tree.release)
            if line.startswith("error "):
                _, num, words = line.split(" ", 2)
                raise OSError(int(num), words.strip())
            raise OSError(f"its keeper could not start it (exit {proc.returncode}): {line.strip()!r}")
        self.main_pid = int(line)
        return proc

    async def release(self) -> None:
        """After the process ended (its keeper killed the rest of its tree): the attempt's cgroup goes."""
        await asyncio.get_running_loop().run_in_executor(None, self.tree.release)

    async def spawn(self, args: list[str], env: dict, cwd: Optional[Path] = None,
                    pass_fds: tuple[int, ...] = ()) -> None:
        """pass_fds: more descriptors the process inherits (a warm standby's assignment pipe)."""
        if self.fifo is not None:
            return await self._spawn_gang(self.fifo, args, env, cwd)
        read_fd, write_fd = os.pipe()
        env = {**self.control_env(env), "TOKENPULSE_EVENT_FD": str(write_fd)}
        # Own session: a signal for the process never reaches the agent, and SIGKILL of the group
        # takes its children (dataloader workers, a launcher's ranks) too; what leaves the group
        # (setsid, a double-forked daemon) is still its keeper's.
        try:
            self.proc = await self._start_kept(args, env, cwd, (write_fd, *pass_fds))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        loop = asyncio.get_running_loop()
        events = self.events = asyncio.StreamReader(limit=1 << 24)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(events), os.fdopen(read_fd, "rb"))

    async def _spawn_gang(self, fifo: Path, args: list[str], env: dict, cwd: Optional[Path]) -> None:
        """Every rank opens the FIFO by path and writes its lines (each below PIPE_BUF: atomic). The
        agent holds a write end itself, so the read end sees no EOF before the first rank opens it;
        release_pipe() drops it once the launcher has exited."""
        if fifo.exists():
            fifo.unlink()
        os.mkfifo(fifo, 0o600)
        read_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        self._hold_fd = os.open(fifo, os.O_WRONLY)
        env = {k: v for k, v in self.control_env(env).items() if k != "TOKENPULSE_EVENT_FD"}
        env["TOKENPULSE_EVENT_PATH"] = str(fifo)
        self.proc = await self._start_kept(args, env, cwd)
        loop = asyncio.get_running_loop()
        events = self.events = asyncio.StreamReader(limit=1 << 24)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(events), os.fdopen(read_fd, "rb"))

    def release_pipe(self) -> None:
        """After the launcher exited: let the event reader reach EOF."""
        if self._hold_fd is not None:
            os.close(self._hold_fd)
            self._hold_fd = None

    def kill_all(self) -> None:
        """SIGKILL the process and every process of its tree (torchrun puts each rank in a session
        of its own; a daemon may have left it): its cgroup, else everything under its keeper."""
        if self.proc is None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.tree.kill(self.proc.pid if self.proc.returncode is None else None)

    def kill_leftovers(self) -> None:
        """A command has exited, but processes it started still hold its output open (a
        background server, a stray worker): the job is over, so they are killed (its keeper does
        so too)."""
        self.kill_all()

    @property
    def pid(self) -> int:
        """The job's own process (the keeper's child)."""
        return self.main_pid if self.main_pid is not None else self.started.pid

    def signal(self, sig: int) -> None:
        """To the process; for a gang to every rank directly (torchrun forwards only SIGTERM, as a
        failure; the ranks agree among themselves on a cancel or pause, at one step)."""
        if self.proc is not None and self.proc.returncode is None:
            for pid in self.ranks():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def signal_group(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    async def stop(self, sig: int, grace_s: float) -> None:
        """Ask politely (sig), then SIGKILL the whole tree after grace_s. The agent's SIGTERM is
        always a cancel (or a stop): announced first, so it is not taken for a preemption."""
        if self.proc is None:  # still starting (a zygote importing): the job run stops it once started
            return
        if sig == signal.SIGTERM:
            self.announce_cancel()
        self.signal(sig)
        await self._reap(grace_s)

    async def _reap(self, grace_s: float) -> None:
        try:
            await asyncio.wait_for(self.started.wait(), grace_s)
        except asyncio.TimeoutError:
            self.kill_all()


class TrainingProcess(Supervised):
    """tokenpulse's own training process (`python -m worker.training.train`)."""

    def __init__(self, spec_path: Path, out_dir: Path, cache_dir: Path, resume_from: Optional[str],
                 command: Optional[list[str]] = None, fifo: Optional[Path] = None):
        super().__init__(fifo)
        self.spec_path, self.out_dir, self.cache_dir = spec_path, out_dir, cache_dir
        self.resume_from = resume_from
        self.command = command  # torchrun's command line for a distributed job (launch.command)

    def train_args(self) -> list[str]:
        args = ["--spec", str(self.spec_path), "--out", str(self.out_dir), "--cache-dir", str(self.cache_dir)]
        return args + (["--resume", self.resume_from] if self.resume_from else [])

    async def start(self) -> None:
        args = [sys.executable, "-u", "-m", "worker.training.train", *self.train_args()]
        await self.spawn(self.command or args, {**os.environ, "PYTHONFAULTHANDLER": "1"})


class CommandProcess(Supervised):
    """A command job's command, run as given (no shell) in its working directory and environment."""

    def __init__(self, argv: list[str], cwd: Path, env: dict, launcher: bool = False):
        # a torchrun command keeps the inherited pipe: its ranks' reporting hook reopens it by /proc
        super().__init__(launcher=launcher)
        self.argv, self.cwd, self.env = argv, cwd, env

    async def start(self) -> None:
        await self.spawn(self.argv, self.env, self.cwd)

    async def stop(self, sig: int, grace_s: float) -> None:
        """SIGTERM goes to the whole process group, as Ctrl+C in a terminal reaches every process of
        the foreground job: a shell script or a launcher (`accelerate launch`, torchrun) and its
        ranks stop together. Other signals (SIGUSR2: checkpoint and pause) go to the leader only."""
        if sig == signal.SIGTERM:
            self.announce_cancel()
            self.signal_group(sig)
        else:
            self.signal(sig)
        await self._reap(grace_s)
