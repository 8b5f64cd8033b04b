"""Warm start: each of tokenpulse's own training jobs starts in a standby forked from the agent's
zygote (worker/agent/zygote.py, worker/training/zygote.py), a process that imported torch,
transformers, datasets and the training code once. A fork shares those pages: a claimed job skips
the seconds (of CPU, not only of latency) a new Python spends importing them, and so does each
relaunch after a fix.

The zygote starts with the agent (TOKENPULSE_WARM_START=lazy: on the first claim it could serve, the
job waiting for its imports as a plain start would). On the claim of a job it can run (tokenpulse's
own training, one process) a standby is forked: a keeper (keeper.py's rules) and under it the
standby, in its own cgroup where there is one, tagged; the job's tree takes it over (start_in:
earlier attempts' survivors killed, its processes moved into the attempt's cgroup) and it is handed
the job on its assignment pipe. Everything else, or anything that makes it unfit, starts plainly and
says why.

Off with TOKENPULSE_WARM_START=0 or `tokenpulse agent --no-warm-start`; no zygote while the machine
has less than TOKENPULSE_WARM_MIN_FREE_MB (default 2048) of memory available: it holds about half a
gigabyte (its forks share it).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional

from tokenpulse.control import ASSIGN_ENV
from tokenpulse.events import FD_ENV
from worker.agent.child import Supervised, TrainingProcess
from worker.agent.keeper import AGENT_PID_ENV, TAG_ENV
from worker.agent.tree import JobTree, job_tag
from worker.agent.zygote import Zygote

log = logging.getLogger("tokenpulse.agent")
WARM_ENV = "TOKENPULSE_WARM_START"
MIN_FREE_ENV = "TOKENPULSE_WARM_MIN_FREE_MB"
DEFAULT_MIN_FREE_MB = 2048.0


def available_mb() -> Optional[float]:
    """MemAvailable (MiB), or None where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Standby(Supervised):
    """A training process forked from the zygote, waiting for its job on its assignment pipe."""

    def __init__(self, server: str, n: int, zygote: Zygote):
        super().__init__()
        self.zygote = zygote
        self.tree = JobTree(f"warm{os.getpid()}.{n}-{job_tag(server, 0)}", job_id=-1, attempt=0)
        self.forked_in = 0.0
        self._assign_fd: Optional[int] = None

    async def start(self) -> None:
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.tree.prepare_standby)
        read_fd, self._assign_fd = os.pipe()
        try:
            await self.spawn([], {**self.zygote.env, "PYTHONFAULTHANDLER": "1", ASSIGN_ENV: str(read_fd)},
                             pass_fds=(read_fd,))
        except BaseException:
            os.close(self._assign_fd)
            self._assign_fd = None
            await loop.run_in_executor(None, self.tree.release)
            raise
        finally:
            os.close(read_fd)
        self.forked_in = time.monotonic() - t0

    async def _start_kept(self, args: list[str], env: dict, cwd: Optional[Path],
                          pass_fds: tuple[int, ...] = ()):
        """Forked by the zygote instead of started by a keeper: the same tree, without the imports."""
        fds = {name: int(env[name]) for name in (FD_ENV, ASSIGN_ENV)}
        env = {**env, TAG_ENV: self.tree.tag, AGENT_PID_ENV: str(os.getpid())}
        proc, self.main_pid = await self.zygote.fork(env, self.tree.cgroup, fds)
        return proc

    def assign(self, argv: list[str], env: dict[str, str]) -> None:
        """The job: train.py's arguments and the attempt's own variables (one line, below PIPE_BUF)."""
        if self._assign_fd is None:
            raise RuntimeError("the standby was already assigned")
        try:
            os.write(self._assign_fd, json.dumps({"argv": argv, "env": env}).encode() + b"\n")
        finally:
            os.close(self._assign_fd)
            self._assign_fd = None

    async def close(self) -> None:
        """Not needed any more: its pipe closed (it exits), its tree killed, its cgroup gone."""
        if self._assign_fd is not None:
            os.close(self._assign_fd)
            self._assign_fd = None
        if self.proc is not None:
            self.kill_all()
            await self.proc.wait()
        await self.release()


class StandbyLost(OSError):
    """The standby ended before it could take the job (its pipe broke): the job starts plainly."""


async def start_in(proc: TrainingProcess, standby: Standby) -> str:
    """The job's process is the standby: an earlier attempt's survivors killed first (as before a
    plain start), the standby's tree made this attempt's (its processes moved to the attempt's
    cgroup, its tag recorded), then the standby handed the job and taken over. Returns what to say."""
    loop = asyncio.get_running_loop()
    said = (f"in standby pid {standby.pid}, forked from the agent's zygote (pid {standby.zygote.pid}) "
            f"in {standby.forked_in:.2f} s")
    try:
        await loop.run_in_executor(None, proc.tree.record_warm, standby.tree.tag)
        await loop.run_in_executor(None, proc.tree.prepare, standby.tree.cgroup)
        standby.tree.cgroup = None  # the attempt's now
        standby.assign(proc.train_args(), proc.control_env({TAG_ENV: proc.tree.tag}))
    except BaseException as e:
        await standby.close()
        if isinstance(e, BrokenPipeError):
            raise StandbyLost(f"its standby ended as it was handed the job ({e})") from e
        raise
    proc.proc, proc.events, proc.main_pid = standby.proc, standby.events, standby.main_pid
    return said


class WarmStart:
    """The agent's zygote, and a standby forked from it for each job it can run."""

    def __init__(self, server: str, cache_dir: Path, off: Optional[str] = None):
        self.server, self.cache_dir = server, cache_dir
        self.off = off  # why every job starts plainly here
        mode = os.environ.get(WARM_ENV, "1").lower()
        if off is None and mode in ("0", "off", "false", "no"):
            self.off = f"warm start is off ({WARM_ENV}={os.environ[WARM_ENV]})"
        self.lazy = mode == "lazy"  # the zygote starts on the first claim it could serve
        self.zygote: Optional[Zygote] = None
        self.why_none = "the zygote has not started yet"
        self._starting: Optional[asyncio.Task] = None
        self._made = 0

    def refill(self, first: bool = True) -> None:
        """Start the zygote in the background (unless off, there, starting, or memory is short).
        first: at the agent's start, which a lazy zygote waits out."""
        if self.off or (first and self.lazy) or self.zygote is not None or \
                (self._starting is not None and not self._starting.done()):
            return
        self._starting = asyncio.create_task(self._start())

    def refill_when(self, settled: Callable[[], bool], limit_s: float = 120.0) -> None:
        """The zygote, if there is none, once `settled()` (the job just started plainly is past its
        own start: its first step, or its end), or limit_s on: its imports would take that start's CPU."""
        if self.zygote is not None or self.off or self.lazy:  # lazy: only a job it can serve starts it
            return

        async def later() -> None:
            end = time.monotonic() + limit_s
            while not settled() and time.monotonic() < end and not self.off:
                await asyncio.sleep(0.25)
            self.refill(first=False)
        asyncio.create_task(later())

    async def _start(self) -> None:
        need = float(os.environ.get(MIN_FREE_ENV) or DEFAULT_MIN_FREE_MB)
        free = available_mb()
        if free is not None and free < need:
            self.why_none = (f"memory is short ({free:.0f} MB available, under {MIN_FREE_ENV}={need:.0f}): "
                             "no zygote kept")
            return
        zygote = Zygote(self.cache_dir, warm_compiler=not self.lazy)
        try:
            await zygote.start()
        except OSError as e:
            self.why_none = f"the zygote could not start: {e}"
            log.warning("warm start: %s", self.why_none)
            return
        self.zygote = zygote

    async def take(self) -> tuple[Optional[Standby], str]:
        """A standby for a job, or None and why it starts plainly."""
        if self.off:
            return None, self.off
        self.refill(first=False)  # a lazy one's first claim: the job waits for the imports it would do itself
        if self._starting is not None and not self._starting.done():
            await self._starting
        zygote = self.zygote
        if zygote is None:
            return None, self.why_none
        why = zygote.unfit(self.cache_dir)
        if why is not None:  # it ends once its running jobs have; a new one for the next claim
            zygote.close()
            self.zygote, self.why_none = None, why
            self.refill(first=False)
            return None, why
        self._made += 1
        standby = Standby(self.server, self._made, zygote)
        try:
            await standby.start()
        except OSError as e:
            return None, f"its standby could not be forked: {e}"
        return standby, ""

    async def close(self) -> None:
        """The agent stops: no more forks (the zygote ends with its last job, or with the agent)."""
        self.off = "the agent is stopping"
        if self._starting is not None and not self._starting.done():
            await self._starting
        if self.zygote is not None:
            self.zygote.close()
