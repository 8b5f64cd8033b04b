"""One training process, supervised: started in its own session, its event pipe and output read
line by line, stopped gracefully (a signal, then SIGKILL after a grace period), its exit judged."""
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


class TrainingProcess:
    def __init__(self, spec_path: Path, out_dir: Path, cache_dir: Path, resume_from: Optional[str],
                 command: Optional[list[str]] = None, fifo: Optional[Path] = None):
        self.spec_path, self.out_dir, self.cache_dir = spec_path, out_dir, cache_dir
        self.resume_from = resume_from
        self.command = command  # torchrun's, for a distributed job (launch.command)
        self.fifo = fifo  # the ranks' event pipe, by path (torchrun closes inherited descriptors)
        self.proc: Optional[asyncio.subprocess.Process] = None
        self.events: Optional[asyncio.StreamReader] = None
        self.tail: deque[str] = deque(maxlen=40)  # last output lines, for the failure reason
        self._hold_fd: Optional[int] = None

    @property
    def gang(self) -> bool:
        return self.fifo is not None

    def ranks(self) -> list[int]:
        """The training processes: torchrun's children for a gang, else the one process."""
        if self.proc is None:
            return []
        return children(self.proc.pid) if self.gang else [self.proc.pid]

    async def start(self) -> None:
        if self.gang:
            return await self._start_gang()
        read_fd, write_fd = os.pipe()
        args = [sys.executable, "-u", "-m", "worker.training.train", "--spec", str(self.spec_path),
                "--out", str(self.out_dir), "--cache-dir", str(self.cache_dir)]
        if self.resume_from:
            args += ["--resume", self.resume_from]
        env = {**os.environ, "TOKENPULSE_EVENT_FD": str(write_fd), "PYTHONFAULTHANDLER": "1"}
        # Own session: a signal for the training process never reaches the agent, and SIGKILL of
        # the group takes its dataloader workers too.
        self.proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
            pass_fds=(write_fd,), start_new_session=True, limit=1 << 20,
            preexec_fn=_die_with_agent if sys.platform.startswith("linux") else None)
        os.close(write_fd)
        loop = asyncio.get_running_loop()
        self.events = asyncio.StreamReader(limit=1 << 24)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(self.events), os.fdopen(read_fd, "rb"))

    async def _start_gang(self) -> None:
        """torchrun and its ranks. Every rank opens the FIFO by path and writes its lines to it; the
        agent holds a write end itself so the read end sees no EOF before the first rank opens it,
        and drops it when torchrun exits (then EOF comes once the last rank is gone)."""
        if self.fifo.exists():
            self.fifo.unlink()
        os.mkfifo(self.fifo, 0o600)
        read_fd = os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK)
        self._hold_fd = os.open(self.fifo, os.O_WRONLY)
        env = {**os.environ, "TOKENPULSE_EVENT_PATH": str(self.fifo), "PYTHONFAULTHANDLER": "1"}
        env.pop("TOKENPULSE_EVENT_FD", None)
        self.proc = await asyncio.create_subprocess_exec(
            *self.command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
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

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        """To the training process; for a gang to every rank directly (torchrun forwards only
        SIGTERM, as a failure, and the ranks agree on a cancel or pause among themselves)."""
        if self.proc is not None and self.proc.returncode is None:
            for pid in self.ranks():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def kill_all(self) -> None:
        """SIGKILL the launcher's group and every process under it: torchrun puts each rank in a
        session of its own, so the group alone would miss them."""
        if self.proc is None:
            return
        pids = descendants(self.proc.pid)
        for pid in [self.proc.pid, *pids]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def stop(self, sig: int, grace_s: float) -> None:
        """Ask politely (sig), then SIGKILL the whole process group (a gang: every rank) after grace_s."""
        self.signal(sig)
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
