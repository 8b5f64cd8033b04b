"""The agent's system metrics loop (readers in sysmetrics.py): each running job's process tree as
sys/ metric events, its memory and GPU use told to its slow detector, and the machine's summary
posted for the workers page. Handed `emit`, and `post_summary` (the server link's)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Optional

from worker.agent import sysmetrics
from worker.agent.running import Emitter, RunningJob

log = logging.getLogger("tokenpulse.agent")


class SystemReporter:
    def __init__(self, jobs: dict[int, RunningJob], emit: Emitter, post_summary: Callable[[dict], Awaitable[None]],
                 agent_id: Callable[[], Optional[int]], stopped: asyncio.Event):
        self.jobs, self.emit, self.post_summary = jobs, emit, post_summary
        self.agent_id, self.stopped = agent_id, stopped
        self.host: Optional[sysmetrics.Host] = None  # the machine's readings, made on first use
        self.gpus: Optional[sysmetrics.Gpus] = None

    async def run(self) -> None:
        """System metrics (sysmetrics.py): each job's process tree a second after it starts, then every
        5 s, as sys/ metric events; the machine every 5 s to the server (the workers page)."""
        loop = asyncio.get_running_loop()
        posted = 0.0
        while not self.stopped.is_set():
            try:
                now = time.monotonic()
                due = [rj for rj in list(self.jobs.values()) if rj.sys is not None and rj.sys.due(now)]
                machine_due = now - posted >= sysmetrics.EVERY_S and self.agent_id() is not None
                if due or machine_due:
                    samples, summary = await loop.run_in_executor(None, self.read, due, now)
                    t = time.time()
                    for rj, values, gpu_util in samples:
                        if rj.process.proc is None or rj.process.proc.returncode is not None:
                            continue  # it ended while we read: its last sample says nothing
                        self.emit(rj, "metrics", {"step": int(t), "values": values}, t)
                        if rj.slow is not None and isinstance(values.get("sys/rss_mb"), (int, float)):
                            step = rj.detector.step
                            if step is None and rj.advice is not None and rj.advice.script.get("passes"):
                                step = 0  # training began, no step ended: its first step's working set
                            rj.slow.observe_memory(t, values["sys/rss_mb"], step)  # memory blow-up
                        if gpu_util is not None and rj.slow is not None:
                            rj.slow.machine.observe_gpu(t, gpu_util)
                    if machine_due:
                        posted = now
                        await self.post_summary(summary)
            except Exception:  # system metrics must never take the agent down
                log.exception("system metrics failed")
            try:
                await asyncio.wait_for(self.stopped.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    def read(self, due: list, now: float) -> tuple[list, dict]:
        """(job, sys/ values, its GPUs' utilisation) per due job, and the machine's summary (a thread)."""
        if self.host is None or self.gpus is None:  # made together, on first use
            self.host, self.gpus = sysmetrics.Host(), sysmetrics.Gpus()
        gpus = self.gpus.read()
        host = self.host.read(now)
        out = []
        for rj in due:
            values = rj.sys.sample(now, host, gpus)
            out.append((rj, values, sysmetrics.job_gpu_util(gpus, rj.sys.pids)))
        return out, self.host.summary(gpus)
