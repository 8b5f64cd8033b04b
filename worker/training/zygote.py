"""The zygote: one process per agent that has imported torch, transformers, datasets and the training
code once, and forks each warm standby from that (worker/agent/zygote.py is the agent's side).

    python -u -m worker.training.zygote --cache-dir DIR --control-fd N

A forked child shares the imported pages and starts in tens of milliseconds, instead of a new Python
spending seconds of CPU importing them again. The zygote runs no torch op and starts no thread of its
own (no OpenMP pool, no CUDA context); when its imports left it unsafe to fork (a CUDA context, a
Python thread) it says why instead of "ready" and the agent starts its jobs plainly.

Protocol on the control socket (AF_UNIX, SOCK_SEQPACKET: one JSON message each, descriptors beside):
  zygote -> agent  {"ready": pid} | {"unsafe": why}           once, after the imports
  agent  -> zygote {"tag", "cgroup", "env", "fd_env"} + fds   stdout, stderr, pid pipe, then fd_env's
  zygote -> agent  {"forked": pid}                             the new standby's keeper
  zygote -> agent  {"exit": pid, "status": wait status}       a keeper ended (reaped here)

Each fork is a keeper (keeper.py's rules: child subreaper, its cgroup, the tree killed when its job
process ends or when the zygote, and so the agent, dies) whose own fork is the standby: a session of
its own, its parent-death signal, the per-standby variables, then standby.py's wait for its job.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import selectors
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

from .runtime import configure as _configure_runtime

_configure_runtime()  # before anything imports torch, as in train.py

from worker.agent import keeper  # noqa: E402

MAX_FDS = 16


def stamp_tag(tag: str) -> None:
    """Write this fork's tag over the zygote's placeholder where /proc/<pid>/environ shows it: that
    is the environment a process started with, not os.environ, and tree.py finds a job's processes
    (this one's forked workers too) by it. As setproctitle rewrites a process's visible arguments."""
    entry = f"{keeper.TAG_ENV}={keeper.TAG_ROOM}".encode()
    environ = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
    i = 0
    while environ[i]:
        addr = environ[i]
        if ctypes.string_at(addr, len(entry) + 1) == entry + b"\0":
            value = tag.encode()[:len(keeper.TAG_ROOM)]
            ctypes.memmove(addr + len(entry) - len(keeper.TAG_ROOM), value + b"\0", len(value) + 1)
            return
        i += 1


def stamp_cmdline(argv: list[str]) -> None:
    """Show argv as this process's command line (/proc/<pid>/cmdline: ps, py-spy, tree tools): a
    standby reads as the training process it is, not as its zygote. The zygote's own arguments end
    with ROOM, which makes space for it."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end (proc(5) fields 48 and 49)
    line = b"\0".join(a.encode() for a in argv)[:end - start - 1]
    ctypes.memmove(start, line + b"\0" * (end - start - len(line)), end - start)


def fork_unsafe() -> str | None:
    """Why forking this process now would hand its children a broken state, or None."""
    extra = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if extra:
        return f"a Python thread runs in the zygote ({', '.join(extra[:3])})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised in the zygote"
    return None


def standby(req: dict, fds: dict[str, int], cache_dir: str) -> None:
    """In the keeper's fork: become the standby (never returns)."""
    code = 1
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()  # as the keeper starts a job: signals for the job never reach the keeper
        keeper.prctl(keeper.PR_SET_PDEATHSIG, signal.SIGKILL)
        keeper.prctl(keeper.PR_SET_PTRACER, int(req["agent"]))  # the agent and its py-spy read stacks (Yama)
        stamp_tag(req["env"][keeper.TAG_ENV])  # before os.environ is changed: then C's environ differs
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ.update({name: str(fds[name]) for name in req["fd_env"]})
        from .standby import wait_for_job
        from .train import main
        stamp_cmdline([sys.executable, "-u", "-m", "worker.training.train", "--standby", "--cache-dir", cache_dir])
        job = wait_for_job()
        if job is not None:
            stamp_cmdline([sys.executable, "-u", "-m", "worker.training.train", *job])
        code = 0 if job is None else main(job)
    except BaseException:  # noqa: BLE001 -- as an uncaught exception ends a plain start
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def keep(req: dict, fds: dict[str, int], zygote: int, cache_dir: str) -> None:
    """In the zygote's fork: the standby's keeper (never returns)."""
    os.setsid()
    for std, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(fds.pop(name), std)
    pid_fd = fds.pop("pid")
    keeper.prctl(keeper.PR_SET_CHILD_SUBREAPER, 1)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    keeper.prctl(keeper.PR_SET_PDEATHSIG, signal.SIGCHLD)
    if os.getppid() != zygote:  # the zygote (and so the agent) died before this line
        os._exit(1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda *_: None)
    cgroup = req.get("cgroup")
    if cgroup:
        try:
            Path(cgroup, "cgroup.procs").write_text("0")
        except OSError:
            cgroup = None
    pid = os.fork()
    if pid == 0:
        os.close(pid_fd)
        standby(req, fds, cache_dir)
    os.write(pid_fd, f"{pid}\n".encode())
    os.close(pid_fd)
    for fd in fds.values():  # the job's ends: the agent sees EOF when the standby is done
        os.close(fd)
    keeper.supervise(pid, zygote, cgroup)


def serve(sock: socket.socket, cache_dir: str) -> None:
    """Fork a standby per request and report each keeper's end. Once the agent hangs up, no more
    forks: it returns when its last keeper has ended (a keeper kills its job when this process dies)."""
    me = os.getpid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears it
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    listening, children = True, 0
    while listening or children:
        for key, _ in sel.select():
            if key.fileobj is wake_r:
                os.read(wake_r, 512)
                children -= reap(sock)  # told after a hang-up too: the agent still waits on them
                continue
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, MAX_FDS)
            if not msg:
                sel.unregister(sock)
                listening = False
                continue
            req = json.loads(msg)
            named = dict(zip(["stdout", "stderr", "pid", *req["fd_env"]], fds))
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for fd in (sock.fileno(), wake_r, wake_w):
                    os.close(fd)
                keep(req, named, me, cache_dir)
            children += 1
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"forked": pid}).encode())


def reap(sock: socket.socket) -> int:
    """Collect every ended keeper, reporting each; returns how many."""
    n = 0
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return n
        if pid == 0:
            return n
        n += 1
        try:
            sock.send(json.dumps({"exit": pid, "status": status}).encode())
        except OSError:
            pass  # the agent is gone: nobody to tell


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m worker.training.zygote")
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--control-fd", type=int, required=True)
    ap.add_argument("--agent-pid", type=int, required=True)
    ap.add_argument("--room", default="", help="space for a fork's command line (stamp_cmdline)")
    ap.add_argument("--warm-compiler", action="store_true", help="also torch.compile's one-time setup (standby.py)")
    args = ap.parse_args(argv)
    keeper.prctl(keeper.PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with its agent; its keepers then kill their trees
    if os.getppid() != args.agent_pid:
        os._exit(1)
    sock = socket.socket(fileno=args.control_fd)
    from .standby import preload, warm_compiler
    preload(Path(args.cache_dir))
    if args.warm_compiler:
        warm_compiler()
    unsafe = fork_unsafe()
    sock.send(json.dumps({"unsafe": unsafe} if unsafe else {"ready": os.getpid()}).encode())
    if unsafe is None:
        serve(sock, args.cache_dir)
    os._exit(0)


if __name__ == "__main__":
    main()
