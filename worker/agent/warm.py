"""Warm start: the agent keeps one training process started ahead of its job (a standby,
worker/training/standby.py), so a claimed job skips the seconds a new Python spends importing torch,
transformers, datasets and the training code.

The standby is started the normal way: under its own keeper (keeper.py: subreaper, its cgroup where
there is one, killed with the agent, kill -9 included), with its event pipe, from the agent's own
environment; it carries a tag of its own (TOKENPULSE_JOB_TREE=warm...). On the claim of a job it can
run (tokenpulse's own training, one process) the job's tree takes it over (start_in: earlier attempts'
survivors killed, its processes moved into the attempt's cgroup, its tag recorded in the job's warm
record for tree.py), it is handed the job on its assignment pipe, and the next standby starts in the
background once that job took its first step (its imports would take the CPU the job's start needs).
Everything else, or anything that makes it unfit, starts plainly and says why.

Off with TOKENPULSE_WARM_START=0 or `tokenpulse agent --no-warm-start`; not kept while the machine has
less than TOKENPULSE_WARM_MIN_FREE_MB (default 2048) of memory available: an idle standby holds about
half a gigabyte.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from tokenpulse.control import ASSIGN_ENV
from worker.agent.child import Supervised, TrainingProcess, describe_exit
from worker.agent.keeper import TAG_ENV
from worker.agent.tree import JobTree, job_tag

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
    """One pre-started training process, not yet assigned a job."""

    def __init__(self, server: str, cache_dir: Path, n: int):
        super().__init__()
        self.cache_dir = cache_dir
        self.tree = JobTree(f"warm{os.getpid()}.{n}-{job_tag(server, 0)}", job_id=-1, attempt=0)
        self.env: dict[str, str] = {}  # the agent's environment it was started with
        self.started_at = 0.0
        self._assign_fd: Optional[int] = None

    async def start(self) -> None:
        self.env = dict(os.environ)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.tree.prepare_standby)
        read_fd, self._assign_fd = os.pipe()
        args = [sys.executable, "-u", "-m", "worker.training.train", "--standby", "--cache-dir", str(self.cache_dir)]
        try:
            await self.spawn(args, {**self.env, "PYTHONFAULTHANDLER": "1", ASSIGN_ENV: str(read_fd)},
                             pass_fds=(read_fd,))
        except BaseException:
            os.close(self._assign_fd)
            self._assign_fd = None
            await loop.run_in_executor(None, self.tree.release)
            raise
        finally:
            os.close(read_fd)
        self.started_at = time.monotonic()

    def waiting(self) -> bool:
        """Its imports are done: it is blocked reading its assignment pipe."""
        try:
            return "pipe" in Path(f"/proc/{self.pid}/wchan").read_text()
        except (OSError, RuntimeError):
            return False

    def unfit(self, cache_dir: Path) -> Optional[str]:
        """Why this standby cannot take a job now (what it imported under would differ), or None."""
        if self.proc is None or self.proc.returncode is not None:
            return f"the standby had ended ({describe_exit(self.proc.returncode or 0)[2]})" if self.proc else \
                "the standby never started"
        changed = sorted(k for k in set(os.environ) | set(self.env) if os.environ.get(k) != self.env.get(k))
        if changed:
            return f"the agent's environment changed since its standby started ({', '.join(changed[:5])})"
        if cache_dir != self.cache_dir:
            return f"the job's cache dir {cache_dir} is not the standby's {self.cache_dir}"
        return None

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
    said = (f"in standby pid {standby.pid}, started {time.monotonic() - standby.started_at:.1f} s before the claim "
            f"({'its imports done' if standby.waiting() else 'still importing'})")
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
    """The agent's one standby: started with the agent and again after each hand-off."""

    def __init__(self, server: str, cache_dir: Path, off: Optional[str] = None):
        self.server, self.cache_dir = server, cache_dir
        self.off = off  # why every job starts plainly here
        if off is None and os.environ.get(WARM_ENV, "1").lower() in ("0", "off", "false", "no"):
            self.off = f"warm start is off ({WARM_ENV}={os.environ[WARM_ENV]})"
        self.standby: Optional[Standby] = None
        self.why_none = "no standby was ready"
        self._starting: Optional[asyncio.Task] = None
        self._made = 0

    def refill(self) -> None:
        """Start the next standby in the background (unless off, one is there, or memory is short)."""
        if self.off or self.standby is not None or (self._starting is not None and not self._starting.done()):
            return
        self._starting = asyncio.create_task(self._start())

    def refill_when(self, settled: Callable[[], bool], limit_s: float = 120.0) -> None:
        """The next standby once `settled()` (the job just started is past its own start: its first
        step, or its end), or limit_s on: its imports would take the CPU that start needs."""
        async def later() -> None:
            end = time.monotonic() + limit_s
            while not settled() and time.monotonic() < end and not self.off:
                await asyncio.sleep(0.25)
            self.refill()
        self.why_none = "the next standby starts after the job before it took its first step: not yet"
        asyncio.create_task(later())

    async def _start(self) -> None:
        need = float(os.environ.get(MIN_FREE_ENV) or DEFAULT_MIN_FREE_MB)
        free = available_mb()
        if free is not None and free < need:
            self.why_none = (f"memory is short ({free:.0f} MB available, under {MIN_FREE_ENV}={need:.0f}): "
                             "no standby kept")
            return
        self._made += 1
        standby = Standby(self.server, self.cache_dir, self._made)
        try:
            await standby.start()
        except OSError as e:
            self.why_none = f"the standby could not start: {e}"
            log.warning("warm start: %s", self.why_none)
            return
        self.standby = standby

    async def take(self) -> tuple[Optional[Standby], str]:
        """The standby for a job (taken: a new one is the caller's refill), or None and why it starts plainly."""
        if self.off:
            return None, self.off
        if self._starting is not None and not self._starting.done():
            await self._starting  # its keeper is starting it: a moment
        standby, self.standby = self.standby, None
        if standby is None:
            return None, self.why_none
        why = standby.unfit(self.cache_dir)
        if why is not None:
            asyncio.create_task(standby.close())
            return None, why
        return standby, ""

    async def close(self) -> None:
        """The agent stops: the standby goes (its keeper would kill it with the agent anyway)."""
        self.off = "the agent is stopping"
        if self._starting is not None and not self._starting.done():
            await self._starting
        standby, self.standby = self.standby, None
        if standby is not None:
            await standby.close()
