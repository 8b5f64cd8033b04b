"""The training process's side of the event pipe.

The agent opens a pipe and passes its write end as TOKENPULSE_EVENT_FD; each event is one JSON line
{"kind", "t", "data"}. The agent adds job id and sequence number. Run standalone (no agent), events
are printed to stderr as readable lines, so `python -m worker.training.train` is useful on its own.

With narrate=True (the training process) the emitter also writes a human-readable account to
stdout: each phase as it starts and ends, every automatic choice with its reason, a step line
(loss, lr, tokens/s, ETA) about twenty times per run and at least every 30 s, checkpoints, alerts
and the final state. The agent relays stdout and stderr as `log` events: this is the job's Log.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Optional

from tokenpulse.protocol import DATA_MODELS, Phase


class Emitter:
    def __init__(self, fd: Optional[int] = None, alive_every: float = 1.0, narrate: bool = False):
        env_fd = os.environ.get("TOKENPULSE_EVENT_FD")
        fd = fd if fd is not None else (int(env_fd) if env_fd else None)
        self._out = os.fdopen(fd, "w", buffering=1) if fd is not None else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.phase_name: Optional[str] = None
        self.step_done: Optional[int] = None  # set by the training loop each step; rides on `alive`
        self._narrate = narrate
        self._said_phase: Optional[tuple] = None
        self._train_total: Optional[float] = None
        self._next_step_line, self._last_step_line_t = 0, 0.0
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
        if self._narrate and kind not in ("alive", "log"):
            try:
                line = self._story(kind, data)
                if line:
                    print(line, flush=True)
            except (BrokenPipeError, ValueError, OSError):
                pass

    def _story(self, kind: str, d: dict) -> Optional[str]:
        """One readable stdout line for an event, or None (most training-phase ticks say nothing)."""
        if kind == "phase":
            name, done, total, unit = d.get("name"), d.get("done"), d.get("total"), d.get("unit") or ""
            if name == Phase.TRAINING:
                self._train_total = total
                if (name, "start") == self._said_phase:
                    return None
                self._said_phase = (name, "start")
                if not total:
                    return "training"
                return f"training {_n(total)} steps" if not done else f"training from step {_n(done)} of {_n(total)}"
            finished = total is not None and done is not None and done >= total
            if finished and name == Phase.SAVING:
                return None  # the checkpoint line that follows says where
            key = (name, "end" if finished else "start")
            if key == self._said_phase and not d.get("detail"):
                return None
            if not finished and self._said_phase and self._said_phase[0] == name and done:
                return None  # progress ticks inside a phase (tokenizing 800/1500) stay in the phase line
            self._said_phase = key
            count = f" {_n(done)}/{_n(total)} {unit}" if finished and unit else ""
            return f"{name}{' done' if finished else ''}{count}{' · ' + d['detail'] if d.get('detail') else ''}"
        if kind == "metrics":
            step, v = d.get("step", 0), d.get("values", {})
            now = time.monotonic()
            total = self._train_total
            last = total is not None and step >= total
            if step < self._next_step_line and now - self._last_step_line_t < 30 and not last:
                return None
            self._next_step_line = step + max(1, -(-int(total or 200) // 20))
            self._last_step_line_t = now
            parts = [f"step {_n(step)}" + (f"/{_n(total)}" if total else "")]
            if "loss" in v:
                parts.append(f"loss {v['loss']:.4g}")
            if "lr" in v:
                parts.append(f"lr {v['lr']:.3g}")
            if "grad_norm" in v:
                parts.append(f"grad norm {v['grad_norm']:.3g}")
            if "tokens_per_s" in v:
                parts.append(f"{v['tokens_per_s']:,.0f} tok/s")
            if "eta_s" in v and not last:
                parts.append(f"ETA {_dur(v['eta_s'])}")
            return " · ".join(parts)
        if kind == "info":
            rest = {k: v for k, v in d.items() if k not in ("reason", "measured")}
            main = ", ".join(f"{k.replace('_', ' ')}={_short(v)}" for k, v in rest.items())
            return f"chose {main}" + (f" ({d['reason']})" if d.get("reason") else "")
        if kind == "checkpoint":
            return f"{'final model' if d.get('final') else 'checkpoint'} saved at step {_n(d.get('step'))}: {d.get('path')}"
        if kind == "alert":
            return f"{'cleared' if d.get('clear') else d.get('severity', 'warning')}: {d.get('kind')}: {d.get('message')}"
        if kind == "state":
            return f"{d.get('state')}: {d.get('reason') or ''}".rstrip(": ")
        return None

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


def _n(x) -> str:
    if x is None:
        return "?"
    return f"{x:,.0f}" if float(x) == int(x) else f"{x:,.1f}"


def _dur(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60} s" if s < 3600 else f"{s // 3600} h {s % 3600 // 60} min"


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (dict, list)):
        t = json.dumps(v)
        return t if len(t) <= 120 else t[:117] + "..."
    return str(v)
