"""The keeper: the one process between the agent and a job's process, owning the job's whole tree.

    python -I keeper.py --agent-pid P --pid-fd N --tag T [--cgroup DIR] [--pass-fd K]... -- argv...

A child that calls setsid(), or a daemon that double-forks, leaves its process group and outlives
its parent: the parent-death signal and a kill of the group miss it. The keeper is a child
subreaper (PR_SET_CHILD_SUBREAPER), so every orphan of the job is re-parented to it instead of init,
and (where the agent made one) it moves itself into the job's cgroup first, so nothing it starts
can leave. It starts the job's process in a session of its own, tells the agent that process's pid
(or why it could not start) on --pid-fd, then waits. When the job's process ends, every process
left in the tree is killed and the keeper exits as that process did (same code, same signal). When
the agent dies (kill -9 included), the whole tree is killed at once: a retry elsewhere never runs
beside a survivor of this attempt.

Stdlib only, run isolated (-I): the job's PYTHONPATH (its instrumentation hook) never loads here.
Every process of the tree carries TOKENPULSE_JOB_TREE=<tag>, which tree.py finds them by.
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_PTRACER = 1, 36, 0x59616D61
POLL_S = 0.5  # a check of the agent at least this often (a SIGCHLD wakes it at once)
TAG_ENV = "TOKENPULSE_JOB_TREE"
AGENT_PID_ENV = "TOKENPULSE_AGENT_PID"
TAG_ROOM = "~" * 120  # a zygote's tag: room each fork writes its own tag into (worker/training/zygote.py)


def prctl(*args: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(*args, *([0] * (5 - len(args))))
    except (OSError, AttributeError):
        pass


def children(pid: int) -> list[int]:
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(x) for x in (task / "children").read_text().split()]
    except (OSError, ValueError):
        pass
    return found


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def cgroup_pids(cgroup: str) -> set[int]:
    try:
        return {int(x) for x in Path(cgroup, "cgroup.procs").read_text().split()}
    except (OSError, ValueError):
        return set()


def reap(main: int, status: dict) -> None:
    """Collect every exited child (orphans re-parented here included); note the job process's status."""
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid == main:
            status["main"] = st


def kill_all(main: int, status: dict, cgroup: str | None) -> None:
    """SIGKILL every process of the tree but this one, until none is left (a process forking while
    it is killed is caught by the next round)."""
    me = os.getpid()
    for _ in range(400):
        pids = set(tree(me)) | (cgroup_pids(cgroup) - {me} if cgroup else set())
        reap(main, status)
        alive = {p for p in pids if _alive(p)}
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)
        reap(main, status)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def exit_as(st: int) -> None:
    if os.WIFSIGNALED(st):
        sig = os.WTERMSIG(st)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the job's crash, not a core of the keeper
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset (OSError)
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 1)


def main(argv: list[str]) -> None:
    sep = argv.index("--")
    opts, command = argv[:sep], argv[sep + 1:]
    agent = int(opts[opts.index("--agent-pid") + 1])
    pid_fd = int(opts[opts.index("--pid-fd") + 1])
    tag = opts[opts.index("--tag") + 1]
    cgroup = opts[opts.index("--cgroup") + 1] if "--cgroup" in opts else None
    passed = [int(opts[i + 1]) for i, o in enumerate(opts) if o == "--pass-fd"]
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    # Woken by SIGCHLD: a child ended, or (as its parent-death signal) the agent died.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    prctl(PR_SET_PDEATHSIG, signal.SIGCHLD)
    if os.getppid() != agent:  # the agent died before this line: run nothing
        os._exit(1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda *_: None)  # the agent signals the job's process, never the keeper
    if cgroup:
        try:
            Path(cgroup, "cgroup.procs").write_text("0")
        except OSError:
            cgroup = None  # the subreaper alone owns the tree

    def prepare() -> None:  # in the job's process, before exec
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the keeper gone: nothing of the job runs on
        prctl(PR_SET_PTRACER, agent)  # the agent and its py-spy may read its stacks (Yama)

    env = {**os.environ, TAG_ENV: tag, AGENT_PID_ENV: str(agent)}
    try:
        proc = subprocess.Popen(command, env=env, pass_fds=passed, start_new_session=True, preexec_fn=prepare)
    except OSError as e:
        os.write(pid_fd, f"error {e.errno or 0} {e.strerror or e}\n".encode())
        os._exit(127)
    os.write(pid_fd, f"{proc.pid}\n".encode())
    os.close(pid_fd)
    for fd in passed:  # the event pipe's end belongs to the job: the agent sees EOF when it is done
        os.close(fd)
    supervise(proc.pid, agent, cgroup)


def supervise(main: int, parent: int, cgroup: str | None) -> None:
    """Wait for the job's process; then kill what is left of the tree and end as it did. The parent
    (the agent; for a zygote's fork, the zygote, which dies with the agent) gone: kill the tree."""
    status: dict = {}
    while True:
        reap(main, status)
        if "main" in status:
            kill_all(main, status, cgroup)  # the job ended: nothing it started runs on
            exit_as(status["main"])
        if os.getppid() != parent:
            kill_all(main, status, cgroup)
            os._exit(1)
        signal.sigtimedwait({signal.SIGCHLD}, POLL_S)


if __name__ == "__main__":
    main(sys.argv[1:])
