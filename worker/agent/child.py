"""One supervised process (tokenpulse's training process, or a command job's command): started in
its own session, its event pipe and output read, stopped gracefully (a signal, then SIGKILL of its
whole process group after a grace period), its exit judged."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import deque
from pathlib import Path
from typing import Optional


def describe_exit(returncode: int) -> tuple[Optional[int], Optional[str], str]:
    """(exit_code, signal name, words) for a process's return code."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (the kernel's OOM killer sends this too)" if name == "SIGKILL" else ""
        return None, name, f"killed by {name}{hint}"
    return returncode, None, f"exited with code {returncode}"


def _die_with_agent() -> None:
    """In the child, before exec: when the agent dies (kill -9 included) the kernel kills the
    training process too. Otherwise it trains on as an orphan whose events go nowhere, while the
    server hands the job to another agent: two processes writing the same job (Linux only)."""
    try:
        import ctypes
        PR_SET_PDEATHSIG, PR_SET_PTRACER = 1, 0x59616D61
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # Where Yama restricts ptrace to ancestors (ptrace_scope=1), let the agent and its children
        # (py-spy) read this process's stacks without root: a frozen process cannot dump its own.
        libc.prctl(PR_SET_PTRACER, os.getppid(), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def children(pid: int) -> list[int]:
    """A process's direct children (Linux /proc); [] where it cannot say."""
    try:
        found = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(x) for x in (task / "children").read_text().split()]
        return found
    except (OSError, ValueError):
        return []


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


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

    @property
    def gang(self) -> bool:
        return self.launcher

    def ranks(self) -> list[int]:
        """The ranks: torchrun's children for a gang, else the one process."""
        if self.proc is None:
            return []
        return children(self.proc.pid) if self.gang else [self.proc.pid]

    async def spawn(self, args: list[str], env: dict, cwd: Optional[Path] = None) -> None:
        if self.fifo is not None:
            return await self._spawn_gang(args, env, cwd)
        read_fd, write_fd = os.pipe()
        env = {**env, "TOKENPULSE_EVENT_FD": str(write_fd)}
        # Own session: a signal for the process never reaches the agent, and SIGKILL of the group
        # takes its children (dataloader workers, a launcher's ranks) too.
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd,
                pass_fds=(write_fd,), start_new_session=True, limit=1 << 20,
                preexec_fn=_die_with_agent if sys.platform.startswith("linux") else None)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        loop = asyncio.get_running_loop()
        self.events = asyncio.StreamReader(limit=1 << 24)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(self.events), os.fdopen(read_fd, "rb"))

    async def _spawn_gang(self, args: list[str], env: dict, cwd: Optional[Path]) -> None:
        """Every rank opens the FIFO by path and writes its lines (each below PIPE_BUF: atomic). The
        agent holds a write end itself, so the read end sees no EOF before the first rank opens it;
        release_pipe() drops it once the launcher has exited."""
        if self.fifo.exists():
            self.fifo.unlink()
        os.mkfifo(self.fifo, 0o600)
        read_fd = os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK)
        self._hold_fd = os.open(self.fifo, os.O_WRONLY)
        env = {k: v for k, v in env.items() if k != "TOKENPULSE_EVENT_FD"}
        env["TOKENPULSE_EVENT_PATH"] = str(self.fifo)
        self.proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd,
            start_new_session=True, limit=1 << 20,
            preexec_fn=_die_with_agent if sys.platform.startswith("linux") else None)
        loop = asyncio.get_running_loop()
        self.events = asyncio.StreamReader(limit=1 << 24)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(self.events), os.fdopen(read_fd, "rb"))

    def release_pipe(self) -> None:
        """After the launcher exited: let the event reader reach EOF."""
        if self._hold_fd is not None:
            os.close(self._hold_fd)
            self._hold_fd = None

    def kill_all(self) -> None:
        """SIGKILL the launcher's group and every process under it: torchrun puts each rank in a
        session of its own, so the group alone would miss them."""
        if self.proc is None:
            return
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    @property
    def pid(self) -> int:
        return self.proc.pid

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
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    async def stop(self, sig: int, grace_s: float) -> None:
        """Ask politely (sig), then SIGKILL the whole process group after grace_s."""
        self.signal(sig)
        await self._reap(grace_s)

    async def _reap(self, grace_s: float) -> None:
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s)
        except asyncio.TimeoutError:
            if self.gang:
                self.kill_all()
                return
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class TrainingProcess(Supervised):
    """tokenpulse's own training process (`python -m worker.training.train`)."""

    def __init__(self, spec_path: Path, out_dir: Path, cache_dir: Path, resume_from: Optional[str],
                 command: Optional[list[str]] = None, fifo: Optional[Path] = None):
        super().__init__(fifo)
        self.spec_path, self.out_dir, self.cache_dir = spec_path, out_dir, cache_dir
        self.resume_from = resume_from
        self.command = command  # torchrun's command line for a distributed job (launch.command)

    async def start(self) -> None:
        args = [sys.executable, "-u", "-m", "worker.training.train", "--spec", str(self.spec_path),
                "--out", str(self.out_dir), "--cache-dir", str(self.cache_dir)]
        if self.resume_from:
            args += ["--resume", self.resume_from]
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
            self.signal_group(sig)
        else:
            self.signal(sig)
        await self._reap(grace_s)

    def kill_leftovers(self) -> None:
        """The command has exited, but processes it started in its group still hold its output open
        (a background server, a stray worker): the job is over, so they are killed."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
