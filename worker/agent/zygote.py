"""The agent's side of the zygote (worker/training/zygote.py): start it, ask it for a forked standby,
and hold each fork's keeper as asyncio holds a process it started (pid, returncode, wait, stdout and
stderr), its end reported by the zygote, its parent.

The zygote is the agent's child and dies with it (its parent-death signal); each fork's keeper then
kills its tree, as a keeper does when the agent dies. Should the zygote die alone, its keepers do the
same: every standby and job it forked ends as killed, and the next jobs start plainly, saying so.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from collections import deque
from pathlib import Path
from typing import Optional

from worker.agent.child import read_line
from worker.agent.keeper import AGENT_PID_ENV, TAG_ENV, TAG_ROOM

log = logging.getLogger("tokenpulse.agent")
OUTPUT_LIMIT = 1 << 20  # as the agent reads a plainly started process's output
CMDLINE_ROOM = "~" * 2048  # a fork shows its training command line there (the spec's and out dir's paths)


class ForkedProcess:
    """A keeper the zygote forked, with what the agent uses of an asyncio.subprocess.Process."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader):
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: Optional[int] = None
        self._done: asyncio.Future = asyncio.get_running_loop().create_future()

    def ended(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        if not self._done.done():
            self._done.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)


async def _pipe_reader(fd: int) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=OUTPUT_LIMIT)
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                       os.fdopen(fd, "rb", 0))
    return reader


class Zygote:
    """One zygote process: started once, then asked for forks until it is closed or dies."""

    def __init__(self, cache_dir: Path, warm_compiler: bool = True):
        self.cache_dir = cache_dir
        self.warm_compiler = warm_compiler  # seconds of CPU more, for a fix's relaunch that compiles
        self.env: dict[str, str] = {}  # the agent's environment it imported under
        self.pid: Optional[int] = None
        self.dead: Optional[str] = None  # why it can fork no more
        self._proc: Optional[asyncio.subprocess.Process] = None
        self._sock: Optional[socket.socket] = None
        self._replies: deque[asyncio.Future] = deque()
        self._forks: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Start it and wait for its imports: ready, or OSError saying why not."""
        self.env = dict(os.environ)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)  # its imports take seconds: the event loop (heartbeats) runs on
        # Its forks write their own tag over this one (worker/training/zygote.py: stamp_tag).
        env = {**self.env, TAG_ENV: TAG_ROOM, AGENT_PID_ENV: str(os.getpid())}
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-u", "-m", "worker.training.zygote", "--cache-dir", str(self.cache_dir),
                "--control-fd", str(theirs.fileno()), "--agent-pid", str(os.getpid()), "--room", CMDLINE_ROOM,
                *(["--warm-compiler"] if self.warm_compiler else []), env={**env, "PYTHONFAULTHANDLER": "1"},
                pass_fds=(theirs.fileno(),), start_new_session=True)
        finally:
            theirs.close()
        self.pid = self._proc.pid
        loop = asyncio.get_running_loop()
        first = json.loads((await loop.sock_recv(ours, 1 << 16)) or b'{"unsafe": "it ended while importing"}')
        if "ready" not in first:
            self._proc.kill()
            await self._proc.wait()
            ours.close()
            raise OSError(f"the zygote cannot fork safely: {first.get('unsafe')}")
        self._sock = ours
        loop.add_reader(ours, self._on_message)
        asyncio.create_task(self._watch())

    def unfit(self, cache_dir: Path) -> Optional[str]:
        """Why its forks cannot take a job now (what it imported under would differ), or None."""
        if self.dead:
            return self.dead
        changed = sorted(k for k in set(os.environ) | set(self.env) if os.environ.get(k) != self.env.get(k))
        if changed:
            return f"the agent's environment changed since its zygote started ({', '.join(changed[:5])})"
        if cache_dir != self.cache_dir:
            return f"the job's cache dir {cache_dir} is not the zygote's {self.cache_dir}"
        return None

    async def fork(self, env: dict[str, str], cgroup: Optional[Path], fds: dict[str, int]) -> tuple[ForkedProcess, int]:
        """A keeper with a standby under it: (the keeper, the standby's pid). env: the standby's
        whole environment; fds: variables naming a descriptor -> the agent's descriptor (passed, and
        the variable set to its number in the standby)."""
        if self.dead or self._sock is None:
            raise OSError(self.dead or "the zygote is not started")
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid_r, pid_w = os.pipe()
        req = {"agent": os.getpid(), "cgroup": str(cgroup) if cgroup else None, "env": env, "fd_env": list(fds)}
        try:
            async with self._lock:  # replies come in request order
                reply: asyncio.Future = loop.create_future()
                self._replies.append(reply)
                socket.send_fds(self._sock, [json.dumps(req).encode()], [out_w, err_w, pid_w, *fds.values()])
                keeper = await reply
        except BaseException:
            for fd in (out_r, err_r, pid_r):
                os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, pid_w):
                os.close(fd)
        try:
            line = await loop.run_in_executor(None, read_line, pid_r)
        finally:
            os.close(pid_r)
        proc = ForkedProcess(keeper, await _pipe_reader(out_r), await _pipe_reader(err_r))
        self._forks[keeper] = proc
        if keeper in self._early_exits:
            proc.ended(self._early_exits.pop(keeper))
        if not line.strip().isdigit():
            raise OSError(f"the zygote's fork could not start its standby: {line.strip()!r}")
        return proc, int(line)

    def _on_message(self) -> None:
        while self._sock is not None:
            try:
                msg = self._sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError as e:
                return self._died(f"its zygote's socket failed ({e})")
            if not msg:
                return self._died("its zygote ended")
            data = json.loads(msg)
            if "forked" in data and self._replies:
                reply = self._replies.popleft()
                if not reply.done():
                    reply.set_result(int(data["forked"]))
            elif "exit" in data:
                pid, status = int(data["exit"]), int(data["status"])
                if pid in self._forks:
                    self._forks.pop(pid).ended(status)
                else:
                    self._early_exits[pid] = status

    def _died(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            log.warning("warm start: %s; its standbys and their jobs end as killed", why)
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock)
            self._sock.close()
            self._sock = None
        for reply in self._replies:
            if not reply.done():
                reply.set_exception(OSError(why))
        self._replies.clear()
        for proc in self._forks.values():  # their keepers saw the zygote die and killed their trees
            proc.ended(signal.SIGKILL)
        self._forks.clear()

    async def _watch(self) -> None:
        if self._proc is not None:
            code = await self._proc.wait()
            if self._sock is not None:
                self._on_message()  # what it said before it ended
            self._died(f"its zygote ended ({code})")

    def close(self) -> None:
        """No more forks: it ends once the last job it forked has ended (before that, its end would
        end them: their keepers kill their trees when it dies)."""
        self.dead = self.dead or "the zygote was closed"
        if self._sock is not None:
            self._sock.shutdown(socket.SHUT_WR)

    async def kill(self) -> None:
        """The agent stops: it and whatever it forked still running end now."""
        self.close()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()
