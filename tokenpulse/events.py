"""The writer side of the event pipe, shared by every process that reports to an agent.

The agent opens a pipe and passes its write end as TOKENPULSE_EVENT_FD; each event is one JSON line
{"kind", "t", "data"}. The agent adds job id and sequence number. Used by the native training
process (worker/training/emit.py), by the zero-code hook in a command job's Python processes
(tokenpulse/instrument/) and by the explicit API (tokenpulse.init/log/...).

Stdlib only at import: the hook loads this into every Python process of a command job, and a
script that never reports should not pay for pydantic. Events are checked against the protocol's
models on first use of a kind that has one (so a bad event fails in the process that made it).

Without a pipe (run standalone), events are printed to stderr as readable lines.
"""
from __future__ import annotations

import json
import os
import stat
import sys
import threading
import time
from typing import Any, Optional

FD_ENV = "TOKENPULSE_EVENT_FD"
# Set by the first process of a job that opens the pipe: "<dev>:<ino>" of the pipe and a path its
# descendants can reopen it by. A grandchild started with close_fds (subprocess's default, torchrun,
# multiprocessing spawn) inherits TOKENPULSE_EVENT_FD but not the descriptor, and the same number
# may then name an unrelated file: writing there would corrupt it.
PIPE_ID_ENV = "TOKENPULSE_EVENT_PIPE_ID"
# A distributed job's ranks (tokenpulse's own training under torchrun) write to a FIFO by path: the
# agent makes it per job; every line carries the writer's `rank` (RANK, when WORLD_SIZE > 1).
FIFO_ENV = "TOKENPULSE_EVENT_PATH"
PIPE_PATH_ENV = "TOKENPULSE_EVENT_PIPE_PATH"

_models = None


def _validate(kind: str, data: dict) -> dict:
    global _models
    if _models is None:
        from tokenpulse.protocol import DATA_MODELS  # pydantic: loaded only when a process reports
        _models = DATA_MODELS
    model = _models.get(kind)
    if model is None:
        return data
    out = model.model_validate(data).model_dump(exclude_none=True, mode="json")
    if kind == "metrics":  # the model reads "nan"/"inf" words as floats; JSON needs the words back
        from tokenpulse.protocol import metric_wire
        out["values"] = {k: metric_wire(v) for k, v in out["values"].items()}
    return out


def _pipe_id(fd: int) -> Optional[str]:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}" if stat.S_ISFIFO(st.st_mode) else None


def open_job_pipe() -> Optional[int]:
    """The write end of this job's event pipe, or None when this process is not part of a job.

    Checks that the descriptor really is the job's pipe; a descendant that lost it reopens it
    through /proc of the process that had it (Linux). Records both for descendants."""
    raw = os.environ.get(FD_ENV)
    if not raw:
        return None
    try:
        fd = int(raw)
    except ValueError:
        return None
    want = os.environ.get(PIPE_ID_ENV)
    have = _pipe_id(fd)
    if have is not None and (want is None or want == have):
        if want is None:  # the first process of the job: tell descendants how to find the pipe
            os.environ[PIPE_ID_ENV] = have
            os.environ[PIPE_PATH_ENV] = f"/proc/{os.getpid()}/fd/{fd}"
        return fd
    path = os.environ.get(PIPE_PATH_ENV)
    if not (want and path):
        return None
    try:
        fd2 = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return None
    if _pipe_id(fd2) != want:
        os.close(fd2)
        return None
    return fd2


class Emitter:
    """Writes events to the pipe (fd), or to stderr as readable lines when there is none."""

    def __init__(self, fd: Optional[int] = None, alive_every: float = 1.0, from_env: bool = True):
        if fd is None and from_env:
            fd = open_job_pipe()
        if fd is None and from_env and os.environ.get(FIFO_ENV):
            fd = os.open(os.environ[FIFO_ENV], os.O_WRONLY | os.O_CLOEXEC)
        self.fd = fd
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.rank: Optional[int] = int(os.environ.get("RANK", "0") or 0) if world > 1 else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.phase_name: Optional[str] = None
        self.step_done: Optional[int] = None  # set by the training loop each step; rides on `alive`
        if alive_every > 0 and self.fd is not None:
            self.start_alive(alive_every)

    def start_alive(self, every: float = 1.0) -> None:
        # A separate thread says "alive" whatever the main thread is doing (a hung step included):
        # alive-but-not-progressing is exactly what tells a hang from a dead process.
        threading.Thread(target=self._alive_loop, args=(every,), daemon=True, name="tokenpulse-alive").start()

    def emit(self, kind: str, /, **data: Any) -> None:
        self.emit_data(kind, _validate(kind, data))

    def emit_data(self, kind: str, data: dict) -> None:
        """Write one event whose data is already in protocol shape."""
        ev = {"kind": kind, "t": time.time(), "data": data}
        if self.rank is not None:
            ev["rank"] = self.rank  # which rank of a distributed job said it
        line = json.dumps(ev, allow_nan=False) + "\n"
        with self._lock:
            if self.fd is not None:
                self._write(line.encode())
            elif kind != "alive":
                print(f"[tokenpulse] {kind}: {json.dumps(data)}", file=sys.stderr, flush=True)

    def _write(self, b: bytes) -> None:
        # One os.write per line: a line up to PIPE_BUF (4 KiB) arrives whole even when several
        # processes of a job share the pipe.
        try:
            while b:
                n = os.write(self.fd, b)
                b = b[n:]
        except (BrokenPipeError, OSError):
            self.fd = None  # the agent is gone; training may still finish and save

    def phase(self, name: str, done: Optional[float] = None, total: Optional[float] = None,
              unit: Optional[str] = None, detail: Optional[str] = None) -> None:
        self.phase_name = name
        self.emit("phase", name=name, done=done, total=total, unit=unit, detail=detail)

    def metrics(self, step: int, **values: float) -> None:
        self.metrics_from(step, values, None)

    def metrics_from(self, step: int, values: dict, source: Optional[str]) -> None:
        """Metrics from one source (tokenpulse/instrument/sources.py), said in the event's `sources`."""
        import math
        clean = {k: float(v) for k, v in values.items() if v is not None}
        # A NaN/inf value is sent as its word (protocol.metric_wire) and stored; it also raises the alert
        # 'non_finite:<name>' (alert rules watch it, server/rules.py), cleared when the metric is finite again.
        bad = getattr(self, "_non_finite", None)
        if bad is None:
            bad = self._non_finite = set()
        for k, v in clean.items():
            if not math.isfinite(v) and k not in bad:
                bad.add(k)
                self.alert(f"non_finite:{k}"[:64], f"{k} is {v} at step {step}", severity="critical")
            elif math.isfinite(v) and k in bad:
                bad.discard(k)
                self.alert(f"non_finite:{k}"[:64], f"{k} is finite again at step {step}", clear=True)
        self.emit("metrics", step=step, values=clean, sources={k: source for k in clean} if source and clean else None)

    def log(self, line: str) -> None:
        self.emit("log", line=line[:8192], stream="stdout")

    def alert(self, kind: str, message: str, severity: str = "warning", clear: bool = False,
              stack: Optional[str] = None) -> None:
        self.emit("alert", kind=kind, message=message, severity=severity, clear=clear, stack=stack)

    def info(self, **data: Any) -> None:
        """Automatic choices and their reasons (precision, padding, batch size...)."""
        self.emit("info", **data)

    def alive_extra(self) -> dict:
        """More for each `alive` (a rank's step time and memory, for the rank table)."""
        return {}

    def _alive_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            if self.step_done is None:
                self.emit_data("alive", {"phase": self.phase_name, **self.alive_extra()})
            else:  # steps between metric points are progress too (log_every > 1, a slow first log)
                self.emit_data("alive", {"phase": self.phase_name, "step": self.step_done, **self.alive_extra()})

    def close(self) -> None:
        self._stop.set()
