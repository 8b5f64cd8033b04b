"""The script side of an external job (a script started by hand with TOKENPULSE_URL and a token).

tokenpulse.init() starts the script's watchdog (tokenpulse/watchdog.py) as a child process with a
pipe and reports into that pipe with the same Emitter as under an agent; the watchdog creates the
job, sends the batches over HTTP, and watches for stalls. At exit, the script's own verdict: an
uncaught exception -> failed with its traceback, a normal exit -> completed (unless finish() said
otherwise first).
"""
from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from typing import Any, Optional

from tokenpulse.events import Emitter

CREATE_TIMEOUT_S = 60.0


def _allow_ptrace(pid: int) -> None:
    """Where Yama restricts ptrace to ancestors, let the watchdog (our child) and its py-spy read us."""
    try:
        import ctypes
        PR_SET_PTRACER = 0x59616D61
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, pid, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class RemoteRun(Emitter):
    """An Emitter writing into the watchdog's pipe, plus the run's id and its end."""

    def __init__(self, proc: subprocess.Popen, job_id: int, url: str, stack_file: Optional[str]):
        super().__init__(fd=proc.stdin.fileno(), alive_every=0, from_env=False)
        self.proc, self.job_id, self.url, self.stack_file = proc, job_id, url, stack_file
        self.finished = False
        self._exc: Optional[BaseException] = None

    @classmethod
    def start(cls, name: str, config: dict, stall: Optional[dict] = None, **_: Any) -> "RemoteRun":
        fd, stack_file = tempfile.mkstemp(prefix="tokenpulse-stack-", suffix=".txt")
        stack_out = os.fdopen(fd, "w")
        # Where py-spy cannot attach, the watchdog sends SIGUSR1 and reads every thread's stack here.
        try:
            faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
        except (AttributeError, ValueError, RuntimeError):
            pass
        env = {k: v for k, v in os.environ.items() if k not in ("TOKENPULSE_EVENT_FD",)}
        env["TOKENPULSE_INSTRUMENT"] = "0"
        proc = subprocess.Popen([sys.executable, "-m", "tokenpulse.watchdog"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, start_new_session=True)
        _allow_ptrace(proc.pid)
        hello = {"name": name, "config": config, "stall": stall or {}, "pid": os.getpid(),
                 "host": socket.gethostname()[:200], "cwd": os.getcwd()[:4096],
                 "command": " ".join([sys.executable] + sys.argv)[:8192], "stack_file": stack_file}
        proc.stdin.write((json.dumps(hello, default=str) + "\n").encode())
        proc.stdin.flush()
        answer = _read_line(proc.stdout, CREATE_TIMEOUT_S)
        if not answer or "id" not in answer:
            why = (answer or {}).get("error", "the watchdog did not answer")
            proc.kill()
            raise RuntimeError(f"tokenpulse.init: {why}")
        run = cls(proc, answer["id"], answer.get("url", ""), stack_file)
        sys.stderr.write(f"tokenpulse: reporting as job {run.job_id} ({run.url})\n")
        run._hook_exit()
        return run

    # ---- the end -------------------------------------------------------------------------------
    def _hook_exit(self) -> None:
        previous = sys.excepthook

        def excepthook(tp, value, tb):
            self._exc = value
            self._tb = "".join(traceback.format_exception(tp, value, tb))
            frames = traceback.extract_tb(tb)
            if frames:  # where it failed, first: "train.py:42 in step: ValueError: ..."
                f = frames[-1]
                self._where = f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}: "
            previous(tp, value, tb)
        sys.excepthook = excepthook
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        if self.finished:
            return
        if self._exc is not None and not isinstance(self._exc, SystemExit):
            tb = getattr(self, "_tb", "")
            self.log(tb[-8000:])
            why = f"{getattr(self, '_where', '')}{type(self._exc).__name__}: {self._exc}"[:4000]
            self.alert("crashed", why, severity="critical")
            self.finish("failed", why + (f"\n{tb[-3000:]}" if tb else ""), failure="error")
        else:
            self.finish("completed", "the script exited normally")

    def finish(self, state: str = "completed", reason: Optional[str] = None, failure: Optional[str] = None) -> None:
        if self.finished:
            return
        self.finished = True
        self.emit("state", state=state, reason=reason, failure=failure)
        self.close()
        try:
            self.proc.stdin.close()  # EOF: the watchdog sends what is left and exits
        except OSError:
            pass
        try:
            self.proc.wait(30)  # the last batch reaches the server before the script exits
        except subprocess.TimeoutExpired:
            pass


def _read_line(stream, timeout: float) -> Optional[dict]:
    got: list = []
    t = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not got or not got[0]:
        return None
    try:
        return json.loads(got[0])
    except ValueError:
        return None
