"""The training process's side of the event pipe.

The agent opens a pipe and passes its write end as TOKENPULSE_EVENT_FD; each event is one JSON line
{"kind", "t", "data"}. The agent adds job id and sequence number. Run standalone (no agent), events
are printed to stderr as readable lines, so `python -m worker.training.train` is useful on its own.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Optional

from tokenpulse.protocol import DATA_MODELS


class Emitter:
    def __init__(self, fd: Optional[int] = None, alive_every: float = 1.0):
        env_fd = os.environ.get("TOKENPULSE_EVENT_FD")
        fd = fd if fd is not None else (int(env_fd) if env_fd else None)
        self._out = os.fdopen(fd, "w", buffering=1) if fd is not None else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.phase_name: Optional[str] = None
        self.step_done: Optional[int] = None  # set by the training loop each step; rides on `alive`
        if alive_every > 0 and self._out is not None:
            # A separate thread says "alive" whatever the main thread is doing (a hung step included):
            # alive-but-not-progressing is exactly what tells a hang from a dead process.
            threading.Thread(target=self._alive_loop, args=(alive_every,), daemon=True,
                             name="tokenpulse-alive").start()

    def emit(self, kind: str, /, **data: Any) -> None:
        model = DATA_MODELS.get(kind)
        if model is not None:  # validate here, so a bad event fails in the process that made it
            data = model.model_validate(data).model_dump(exclude_none=True, mode="json")
        line = json.dumps({"kind": kind, "t": time.time(), "data": data}, allow_nan=False)
        with self._lock:
            if self._out is not None:
                try:
                    self._out.write(line + "\n")
                except (BrokenPipeError, ValueError):
                    pass  # the agent is gone; training may still finish and save
            elif kind != "alive":
                print(f"[tokenpulse] {kind}: {json.dumps(data)}", file=sys.stderr, flush=True)

    def phase(self, name: str, done: Optional[float] = None, total: Optional[float] = None,
              unit: Optional[str] = None, detail: Optional[str] = None) -> None:
        self.phase_name = name
        self.emit("phase", name=name, done=done, total=total, unit=unit, detail=detail)

    def metrics(self, step: int, **values: float) -> None:
        import math
        clean = {k: float(v) for k, v in values.items() if v is not None}
        # NaN/inf cannot travel in JSON; the loop raises its own alert for a non-finite loss.
        clean = {k: v for k, v in clean.items() if math.isfinite(v)}
        self.emit("metrics", step=step, values=clean)

    def log(self, line: str) -> None:
        self.emit("log", line=line[:8192], stream="stdout")

    def alert(self, kind: str, message: str, severity: str = "warning", clear: bool = False) -> None:
        self.emit("alert", kind=kind, message=message, severity=severity, clear=clear)

    def info(self, **data: Any) -> None:
        """Automatic choices and their reasons (precision, padding, batch size...)."""
        self.emit("info", **data)

    def _alive_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            if self.step_done is None:
                self.emit("alive", phase=self.phase_name)
            else:  # steps between metric points are progress too (log_every > 1, a slow first log)
                self.emit("alive", phase=self.phase_name, step=self.step_done)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._out is not None:
                try:
                    self._out.flush()
                except (BrokenPipeError, ValueError):
                    pass
