"""A running job's event pipe and output, read: each event classed by its rank and kind (other ranks'
kept to what is stored for every rank), fed to the job's detectors and forwarded through `emit`; its
stdout/stderr folded into log lines (progress-bar redraws, secrets masked). The seam: what a job says
(job_stream.py) apart from what the agent does to it (job_run.py)."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Optional

from tokenpulse.protocol import AlertKind
from worker.agent.output import LineFolder
from worker.agent.running import Emitter, RunningJob


def is_anatomy(data: dict) -> bool:
    """A rank's step-anatomy metrics (tokenpulse/instrument/patch_torch.py): stored for every rank."""
    values = data.get("values")
    return isinstance(values, dict) and bool(values) and all(str(k).startswith("anatomy/") for k in values)



class JobStream:
    def __init__(self, emit: Emitter, snapshot_s: float):
        self.emit, self.snapshot_s = emit, snapshot_s

    async def read_events(self, rj: RunningJob) -> None:
        reader = rj.process.events
        if reader is None:  # never spawned: no event pipe
            return
        while True:
            line = await reader.readline()
            if not line:
                return
            try:
                ev = json.loads(line)
                kind, data, t = ev["kind"], ev.get("data", {}), float(ev.get("t", time.time()))
                rank = ev.get("rank")
                rank = int(rank) if rank is not None else None
            except (ValueError, KeyError, TypeError):
                self.emit(rj, "log", {"line": f"bad event line: {line[:200]!r}", "stream": "agent"})
                continue
            now = time.time()
            rj.alive_at = now
            if rank is not None and rj.gang is not None:
                rj.gang.observe(rank, kind, data, t, now)
                if rank != 0:  # other ranks: their identity, alerts and step anatomy are stored; the rest is theirs
                    if kind == "metrics" and is_anatomy(data):
                        if rj.slow is not None:
                            rj.slow.observe_anatomy(data, now)
                        self.emit(rj, kind, data, t)
                    elif kind == "alert":
                        extra = {"data": None} if rj.command is not None else {}  # as below: not a command's word
                        self.emit(rj, kind, {**data, **extra,
                                             "message": f"rank {rank}: {data.get('message', '')}"[:8192]}, t)
                    elif kind == "info":
                        self.emit(rj, kind, data, t)
                    elif kind == "state" and rj.claim.node_rank and rj.child_state is None:
                        rj.child_state = data  # another node's end is judged by its own ranks' word
                    continue
            if rj.sourced is not None:
                data = self.sourced(rj, kind, data)
                if data is None:
                    continue
            recovered = rj.detector.observe(kind, data, now)  # alive events: alive, not progress
            if recovered is not None:  # cleared once it kept moving for alert_clear_s (detect())
                rj.stall_clear = (now, recovered.message)
            if kind == "alive":
                continue  # carried by the heartbeat, not stored one by one
            if rj.slow is not None:
                rj.slow.observe(kind, data, now)
            if rj.advice is not None:
                rj.advice.observe(kind, data, now)
                if rj.detector.last_progress == now and rj.advice.quiet.over():
                    self.emit(rj, "alert", {"kind": AlertKind.QUIET, "clear": True,
                                            "message": f"progress reported again: {rj.detector.where()}"})
                    if kind != "phase" and rj.advice.quiet.phase:  # the quiet line gives way to the process's own
                        self.emit(rj, "phase", rj.advice.quiet.phase)
            if rj.command is not None:
                if kind == "alert" and "data" in data:
                    # fixes and costs are the agent's word (worker/agent/fixes.py): a command's own alert
                    # must not plant a change of its command line behind an "Apply fix" button
                    data = {k: v for k, v in data.items() if k != "data"}
                data = self.masked(rj, kind, data)
                if kind == "info" and data.get("pausable") is not None:
                    # The instrumentation's promise (a Trainer callback) that SIGUSR2 makes the process
                    # save a checkpoint and exit paused; without it a command job is never sent SIGUSR2.
                    rj.pausable = bool(data["pausable"])
            if kind == "state":
                rj.child_state = data  # judged together with the exit code, in supervise()
                continue
            if kind == "checkpoint" and not data.get("final") and data.get("requested"):
                self.emit(rj, "log", {"line": self.checkpoint_words(rj, data, now), "stream": "agent"})
            self.emit(rj, kind, data, t)

    def sourced(self, rj: RunningJob, kind: str, data: dict) -> Optional[dict]:
        """A metrics event's `sources` (and the logging calls the process names in its info) become
        the job's info `metric_sources`, sent when it changes."""
        assert rj.sourced is not None
        out = rj.sourced.observe(kind, data)
        self.sources_info(rj)
        return out

    def printed_metrics(self, rj: RunningJob, line: str) -> None:
        """The last resort for a loss: the job's printed lines (printed_metrics.py)."""
        assert rj.sourced is not None
        for kind, data in rj.sourced.printed(line):
            self.emit(rj, kind, data)
        self.sources_info(rj)

    def sources_info(self, rj: RunningJob) -> None:
        assert rj.sourced is not None
        info = rj.sourced.sources_info()
        if info is not None:
            self.emit(rj, "info", info)

    @staticmethod
    def checkpoint_words(rj: RunningJob, data: dict, now: float) -> str:
        """A checkpoint that was asked for, and how long it took: the process measures from its signal,
        the agent from when it asked (a SIGTERM from outside: the agent did not ask)."""
        sig = str(data.get("requested"))
        why = {"SIGUSR2": "asked for (pause or stop)", "SIGTERM": "on a SIGTERM from outside (preemption)"}.get(
            sig, f"asked for ({sig})")
        words = (f"agent: checkpoint at step {data.get('step')} {why}: saved {data.get('request_s', 0):.1f} s "
                 "after the signal")
        if sig == "SIGUSR2" and rj.asked_at is not None:
            words += f" ({now - rj.asked_at:.1f} s after this agent asked)"
        return words

    @staticmethod
    def masked(rj: RunningJob, kind: str, data: dict) -> dict:
        """Secret values never leave the agent, even when the job's own events carry them: every
        string, keys included (the outbox masks again whatever the agent adds to it)."""
        return rj.mask.data(data)

    async def read_output(self, rj: RunningJob, stream: asyncio.StreamReader, name: str) -> None:
        """Output as log lines, progress-bar redraws folded (output.LineFolder); a line that keeps
        redrawing without a newline is logged once per snapshot_s, and only when it changed."""
        fold = LineFolder(self.snapshot_s, mask=rj.mask)  # masked before a long line is cut
        while True:
            try:
                raw = await asyncio.wait_for(stream.read(1 << 16), min(self.snapshot_s, 5.0))
            except asyncio.TimeoutError:
                lines = fold.tick(time.time())
            else:
                lines = fold.feed(raw, time.time()) if raw else fold.close()
                if not raw:
                    for line in lines:
                        self.output_line(rj, name, line)
                    return
            for line in lines:
                self.output_line(rj, name, line)

    def output_line(self, rj: RunningJob, name: str, line: str) -> None:
        if rj.command is not None:
            line = rj.mask(line)
            if name == "stderr":
                rj.stderr_tail.append(line)
            if rj.detector.events == 0:  # no instrumentation speaking for it: its output is its sign of life
                rj.alive_at = time.time()
        rj.process.tail.append(line)
        if rj.advice is not None and rj.stack_lines is None:
            rj.advice.output(line)
        if rj.stack_lines is not None and name == "stderr":
            rj.stack_lines.append(line)
        elif rj.stack_lines is None:  # a stack dump we asked for is not the job's own output
            recovered = rj.detector.observe_output(time.time())  # movement only for a job with no other signal
            if recovered is not None:
                self.emit(rj, "alert", {"kind": AlertKind.STALLED, "message": recovered.message, "clear": True})
        self.emit(rj, "log", {"line": line[:8192], "stream": name})
        if rj.sourced is not None and rj.stack_lines is None:
            self.printed_metrics(rj, line)
