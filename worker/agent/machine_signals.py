"""What the agent samples about the machine beside a job's own metrics, for the slow detector
(slow.py): its GPUs' utilisation (an idle GPU is a slow reason) and the training process's CPU waits
with the load average (slowness that is only other processes holding the CPUs is contention, not a
slow job). The seam: the job's metrics are the job's word; these are the machine's."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

GPU_IDLE_PCT = 10.0  # a training job's GPUs below this utilisation (median of a minute) are idle


@dataclass
class MachineSignals:
    gpu_util: list = field(default_factory=list)  # (t, utilisation %) of the job's GPUs (sysmetrics.py)
    load: Optional[tuple] = None  # (1-minute load average, cores): observe_load
    sched: list = field(default_factory=list)  # (t, cpu seconds, cpu-wait seconds) of the process

    def observe_gpu(self, now: float, util: float) -> None:
        """The job's GPUs' utilisation (NVML, sampled by the agent every few seconds)."""
        self.gpu_util.append((now, util))
        if len(self.gpu_util) > 200:
            del self.gpu_util[:100]

    def gpu_idle(self, was_open: frozenset) -> Optional[str]:
        """The GPU mostly idle while steps go by: the work is elsewhere (data loading, the CPU, a
        sync). Judged on the last minute's samples; clears at twice the bar."""
        recent = [u for t, u in self.gpu_util if t >= self.gpu_util[-1][0] - 60] if self.gpu_util else []
        if len(recent) < 3:
            return None
        u = statistics.median(recent)
        bar = GPU_IDLE_PCT * (2 if "gpu_idle" in was_open else 1)
        if u >= bar:
            return None
        return (f"the GPU sits idle while the job trains: {u:.0f} % utilisation over the last "
                f"{len(recent)} samples; the time goes to data loading, the CPU or waiting (see the System charts)")

    def observe_load(self, load_avg: float, cores: Optional[int]) -> None:
        """The machine's 1-minute load average and its cores, read by the agent before each check."""
        self.load = (load_avg, cores)

    def observe_sched(self, now: float, run_s: float, wait_s: float) -> None:
        """The training process's scheduler counters (read_schedstat), sampled by the agent."""
        if self.sched and now - self.sched[-1][0] < 0.2:
            return
        self.sched.append((now, run_s, wait_s))
        if len(self.sched) > 4000:
            del self.sched[:2000]

    def waiting_share(self, t0: float, t1: float) -> Optional[float]:
        """Of the time the process wanted a CPU between t0 and t1, the share it spent waiting for one."""
        pts = [x for x in self.sched if t0 <= x[0] <= t1]
        if len(pts) < 2:
            return None
        run, wait = pts[-1][1] - pts[0][1], pts[-1][2] - pts[0][2]
        return wait / (run + wait) if run + wait > 0 else None

    def starved(self, samples: list, window: int, relative: bool = True) -> Optional[str]:
        """Is the recent slowness (the last `window` of the slow detector's samples) explained by CPU
        starvation (other processes hold the CPUs)? The process was runnable but waiting most of the
        time, far more than earlier in the job. An injected sleep, I/O or a slower step is not
        waiting for a CPU: those stay 'slow'."""
        if len(samples) <= window:
            return None
        t_start = samples[-window - 1].t
        now_share = self.waiting_share(t_start, samples[-1].t)
        before = self.waiting_share(samples[0].t, t_start)
        if now_share is None or now_share < 0.5 or (relative and before is not None and now_share - before < 0.25):
            return None
        load = (f"; load {self.load[0]:.1f} on {self.load[1]} cores" if self.load else "")
        return (f"the training process waited for a CPU {now_share:.0%} of the time it was runnable "
                f"(earlier: {before:.0%}){load}: other processes on this machine hold the CPUs"
                if before is not None else
                f"the training process waited for a CPU {now_share:.0%} of the time it was runnable{load}")
