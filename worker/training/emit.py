"""The training process's side of the event pipe: tokenpulse.events.Emitter (shared with command
jobs' instrumentation and the explicit API, so every process of a job writes the same lines), plus
the training process's own narration. Run standalone (no agent), events are printed to stderr as
readable lines, so `python -m worker.training.train` is useful on its own.

With narrate=True (the training process) the emitter also writes a human-readable account to
stdout: each phase as it starts and ends, every automatic choice with its reason, a step line
(loss, lr, tokens/s, ETA) about twenty times per run and at least every 30 s, checkpoints, alerts
and the final state. The agent relays stdout and stderr as `log` events: this is the job's Log.

Under torchrun (WORLD_SIZE > 1) every rank writes its lines with `rank` (tokenpulse.events); ranks
other than 0 send only what is theirs: alive (with their step, step time and memory), their
identity (`info` with `rank`), alerts and how they ended; rank 0 tells the job's story.
"""
from __future__ import annotations

import json
import time
from typing import Optional

from tokenpulse.events import Emitter as PipeEmitter
from tokenpulse.protocol import Phase


class Emitter(PipeEmitter):
    def __init__(self, fd: Optional[int] = None, alive_every: float = 1.0, narrate: bool = False):
        self._narrate = narrate
        self._said_phase: Optional[tuple] = None
        self._said_training = False
        self._train_total: Optional[float] = None
        self._next_step_line, self._last_step_line_t = 0, 0.0
        self.rank_step: Optional[dict] = None  # this rank's step and busy time, set by the loop
        self._proc = None
        super().__init__(fd=fd, alive_every=alive_every)
        self._narrate = narrate and not self.rank  # one readable account per job: rank 0's

    def alive_extra(self) -> dict:
        if self.rank is None:
            return {}
        if self._proc is None:
            import psutil
            self._proc = psutil.Process()
        # per-rank telemetry for the rank table and the straggler check
        return {**(self.rank_step or {}), "rss_mb": round(self._proc.memory_info().rss / 2 ** 20, 1)}

    def emit_data(self, kind: str, data: dict) -> None:
        if self.rank and not (kind in ("alive", "state", "alert") or kind == "info" and "rank" in data):
            return  # a rank other than 0: the job's story is rank 0's
        super().emit_data(kind, data)
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
                if self._said_training:
                    return None  # back from a checkpoint or an evaluation: the step lines go on
                self._said_training = True  # once per attempt ("training from step N" on a resume)
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
            what = "final model" if d.get("final") else "checkpoint"
            return f"{what} saved at step {_n(d.get('step'))}: {d.get('path')}"
        if kind == "alert":
            level = "cleared" if d.get("clear") else d.get("severity", "warning")
            return f"{level}: {d.get('kind')}: {d.get('message')}"
        if kind == "state":
            return f"{d.get('state')}: {d.get('reason') or ''}".rstrip(": ")
        return None


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
