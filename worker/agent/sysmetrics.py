"""System metrics: what a job's whole process tree and its machine use, sampled by the agent every few
seconds from the moment the job starts (not from its first log line).

A job's series (stored as ordinary metrics under `sys/`, keyed by whole Unix seconds: a retry's
samples continue the same series instead of overwriting the first attempt's):
  sys/cpu_pct          the tree's CPU use, in % of one core (400 = four cores busy)
  sys/rss_mb           the tree's resident memory
  sys/disk_read_mbps   the tree's disk reads and writes (MB/s; processes that ended take theirs along)
  sys/disk_write_mbps
  sys/host_cpu_pct     the machine: CPU use (% of all cores), memory used, network in and out (MB/s;
  sys/host_mem_pct     per-process network counters do not exist)
  sys/net_recv_mbps, sys/net_sent_mbps
  sys/gpu<i>_util_pct, sys/gpu<i>_mem_mb, sys/gpu<i>_power_w, sys/gpu<i>_temp_c   each GPU the machine has
  sys/gpu_mem_mb       the tree's own GPU memory, when NVML lists its processes

GPUs are read through NVML (nvidia-ml-py's `pynvml`): a machine without the library or without an
NVIDIA GPU simply has no GPU series. psutil reads everything else.
"""
from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional

import psutil

log = logging.getLogger("tokenpulse.agent")

EVERY_S = 5.0  # a sample every 5 s: ~12 points a minute per series, nothing next to training metrics
FIRST_S = 1.0  # the first one a second after the start (a CPU share needs two readings)
MB = 1e6


class Gpus:
    """NVML, initialised once; absent (no library, no driver, no GPU) means an empty list."""

    def __init__(self):
        self.nvml = None
        self.handles: list = []
        try:
            import pynvml  # nvidia-ml-py
            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.nvml = pynvml
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            log.debug("no GPU metrics: %s", e)

    def read(self) -> list[dict]:
        """Per GPU: util_pct, mem_mb, power_w, temp_c (what the driver answers), and pids -> MB."""
        out: list[dict] = []
        nv = self.nvml
        if nv is None:  # no NVML: no handles either
            return out
        for h in self.handles:
            g: dict = {"pids": {}}
            for key, read in (("util_pct", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                              ("mem_mb", lambda: nv.nvmlDeviceGetMemoryInfo(h).used / MB),
                              ("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
                              ("temp_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))):
                try:
                    g[key] = float(read())
                except Exception:  # a field this GPU does not report (power on some boards)
                    pass
            try:
                for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                    g["pids"][p.pid] = (p.usedGpuMemory or 0) / MB
            except Exception:
                pass
            out.append(g)
        return out


class Host:
    """The machine's CPU, memory and network, read once per sampling round for every job on it."""

    def __init__(self):
        self.net: Optional[tuple] = None  # (t, bytes received, bytes sent) at the last read
        psutil.cpu_percent(None)  # the first call only starts the count
        self.values: dict[str, float] = {}

    def read(self, now: float) -> dict[str, float]:
        vm = psutil.virtual_memory()
        v = {"sys/host_cpu_pct": psutil.cpu_percent(None), "sys/host_mem_pct": vm.percent}
        n = psutil.net_io_counters()
        if n is not None:
            if self.net is not None and now > self.net[0]:
                dt = now - self.net[0]
                v["sys/net_recv_mbps"] = max(0, n.bytes_recv - self.net[1]) / MB / dt
                v["sys/net_sent_mbps"] = max(0, n.bytes_sent - self.net[2]) / MB / dt
            self.net = (now, n.bytes_recv, n.bytes_sent)
        self.values = v
        return v

    def summary(self, gpus: list[dict]) -> dict:
        """The agent's machine now, for the workers page (after read())."""
        vm = psutil.virtual_memory()
        return {"cpu_pct": self.values.get("sys/host_cpu_pct", 0.0), "cores": psutil.cpu_count() or 1,
                "mem_used_mb": round((vm.total - vm.available) / MB, 1), "mem_total_mb": round(vm.total / MB, 1),
                "load1": round(psutil.getloadavg()[0], 2),
                "net_recv_mbps": self.values.get("sys/net_recv_mbps"),
                "net_sent_mbps": self.values.get("sys/net_sent_mbps"),
                "gpus": [{k: v for k, v in g.items() if k != "pids"} for g in gpus], "t": time.time()}


@dataclass
class TreeSampler:
    """One job's process tree: counters kept between samples so rates are per second."""
    pid: int
    started: float = field(default_factory=time.monotonic)
    last_at: Optional[float] = None
    cpu: dict = field(default_factory=dict)  # pid -> cpu seconds at the last sample
    io: dict = field(default_factory=dict)  # pid -> (read bytes, write bytes) at the last sample
    pids: set = field(default_factory=set)  # the tree at the last sample
    peak_rss_mb: float = 0.0  # the highest sys/rss_mb sampled (an OOM's give-up names it)
    peak_gpu_mb: float = 0.0  # the highest sys/gpu_mem_mb sampled

    def due(self, now: float) -> bool:
        if self.last_at is None:
            return now - self.started >= FIRST_S
        return now - self.last_at >= EVERY_S

    def processes(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root] + root.children(recursive=True)
        except psutil.Error:
            return []

    def sample(self, now: float, host: dict[str, float], gpus: list[dict]) -> dict[str, float]:
        """sys/ values for this moment; rates are over the time since the previous sample."""
        dt = now - (self.last_at if self.last_at is not None else self.started)
        self.last_at = now
        rss = cpu_s = rd = wr = 0.0
        cpu_now, io_now = {}, {}
        for p in self.processes():
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    cpu_now[p.pid] = t.user + t.system
                    rss += p.memory_info().rss
                    try:
                        c = p.io_counters()
                        io_now[p.pid] = (c.read_bytes, c.write_bytes)
                    except (psutil.AccessDenied, AttributeError):
                        pass
            except psutil.Error:
                continue
        for pid, c in cpu_now.items():  # a process new since the last sample counts from zero
            cpu_s += max(0.0, c - self.cpu.get(pid, 0.0))
        for pid, (r, w) in io_now.items():
            r0, w0 = self.io.get(pid, (0, 0))
            rd, wr = rd + max(0, r - r0), wr + max(0, w - w0)
        self.cpu, self.io = cpu_now, io_now
        values = {"sys/cpu_pct": max(0.0, 100.0 * cpu_s / dt) if dt > 0 else 0.0, "sys/rss_mb": rss / MB,
                  "sys/disk_read_mbps": rd / MB / dt if dt > 0 else 0.0,
                  "sys/disk_write_mbps": wr / MB / dt if dt > 0 else 0.0,
                  **host}
        mine = self.pids = set(cpu_now)
        own_gpu = 0.0
        for i, g in enumerate(gpus):
            for key in ("util_pct", "mem_mb", "power_w", "temp_c"):
                if key in g:
                    values[f"sys/gpu{i}_{key}"] = g[key]
            own_gpu += sum(mb for pid, mb in g["pids"].items() if pid in mine)
        if any(g["pids"] for g in gpus):
            values["sys/gpu_mem_mb"] = own_gpu
            self.peak_gpu_mb = max(self.peak_gpu_mb, own_gpu)
        self.peak_rss_mb = max(self.peak_rss_mb, rss / MB)
        return {k: round(v, 3) for k, v in values.items()}


def job_gpu_util(gpus: list[dict], pids: set[int]) -> Optional[float]:
    """The mean utilisation of the GPUs this job's processes use (all of the machine's when NVML does
    not say which), for the slow detector's 'GPU idle' reason; None without GPUs."""
    if not gpus:
        return None
    used = [g for g in gpus if pids & set(g["pids"])] or gpus
    utils = [g["util_pct"] for g in used if "util_pct" in g]
    return sum(utils) / len(utils) if utils else None


# ---- what this agent trains on; what the slow detector is told: the GPU's kind, CPU waits -------

def describe_device() -> str:
    """What this agent trains on, without importing torch into the agent (nvidia-smi if present)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
            if out:
                return "cuda: " + "; ".join(line.strip() for line in out.splitlines())
        except (OSError, subprocess.TimeoutExpired):
            pass
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def gpu_info() -> tuple[Optional[str], bool]:
    """(GPU name or None, whether it has bf16) from nvidia-smi, without importing torch."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None, False
    try:
        out = subprocess.run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None, False
    if not out:
        return None, False
    name, _, cap = out.splitlines()[0].partition(",")
    try:
        bf16 = float(cap.strip()) >= 8.0
    except ValueError:
        bf16 = False
    return name.strip(), bf16


def read_schedstat(pid: int) -> Optional[tuple[float, float]]:
    """(seconds on a CPU, seconds runnable but waiting for a CPU), summed over the process's threads,
    from /proc/<pid>/task/*/schedstat (Linux); None where unavailable."""
    run = wait = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                parts = f.read().split()
            run += int(parts[0])
            wait += int(parts[1])
        except (OSError, ValueError, IndexError):
            continue
    return run / 1e9, wait / 1e9
