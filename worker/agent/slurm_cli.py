"""Slurm's command-line tools, the only way tokenpulse talks to Slurm: sbatch, squeue, scancel,
sacct (falling back to `scontrol show job` where accounting is off), sinfo. Each call runs in a
subprocess without blocking the event loop; the clients find the cluster as usual (SLURM_CONF)."""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("tokenpulse.slurm")

# Slurm's job states that are over (squeue --states=all keeps them MinJobAge seconds)
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "RESV_DEL_HOLD"}


class SlurmError(RuntimeError):
    pass


@dataclass
class QueuedJob:
    """One line of squeue: a Slurm job as the queue sees it."""
    slurm_id: str
    name: str
    state: str  # PENDING, RUNNING, COMPLETING, COMPLETED, TIMEOUT, ...
    reason: str  # squeue %r: Priority, Resources, Dependency, None...
    comment: str
    nodes: str

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    @property
    def pending(self) -> bool:
        return self.state in PENDING


def unreachable(error: str) -> bool:
    """sbatch's words for a controller it could not reach (not the job's fault)."""
    e = error.lower()
    return any(w in e for w in ("unable to contact slurm controller", "socket timed out", "connection refused",
                                "slurm_persist_conn", "not responding", "temporarily unavailable"))


async def run(*argv: str, timeout: float = 60, check: bool = True) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env=os.environ.copy())
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise SlurmError(f"{argv[0]} did not answer in {timeout:.0f} s") from None
    if check and proc.returncode != 0:
        raise SlurmError(f"{' '.join(argv[:2])} failed ({proc.returncode}): "
                         f"{(err or out).decode(errors='replace').strip()[:1000]}")
    return out.decode(errors="replace")


async def submit(options: list[str], script: str) -> str:
    """sbatch the script with these options; the Slurm job id."""
    out = await run("sbatch", "--parsable", *options, script)
    return out.strip().split(";")[0]


async def queue() -> list[QueuedJob]:
    """This user's Slurm jobs, finished ones still in slurmctld's memory included."""
    out = await run("squeue", "--me", "-h", "--states=all", "-o", "%i\x1f%j\x1f%T\x1f%r\x1f%k\x1f%N")
    jobs = []
    for line in out.splitlines():
        parts = line.split("\x1f")
        if len(parts) == 6:
            jobs.append(QueuedJob(*(p.strip() for p in parts)))
    return jobs


async def cancel(slurm_id: str) -> None:
    await run("scancel", slurm_id, check=False)


async def record(slurm_id: str) -> dict[str, str]:
    """How a Slurm job ended: sacct's record (State, ExitCode, Reason, Elapsed, NodeList...), or
    without accounting (no slurmdbd) `scontrol show job`'s (JobState, ExitCode, Reason...), with
    `State` and `source` filled either way. Empty when neither knows the job."""
    try:
        out = await run("sacct", "-j", slurm_id, "-X", "-n", "-P", "-o",
                        "JobID,State,ExitCode,Reason,Elapsed,Timelimit,NodeList,End", timeout=30)
        for line in out.splitlines():
            f = line.split("|")
            if len(f) >= 8 and f[0] == slurm_id:
                keys = ("JobID", "State", "ExitCode", "Reason", "Elapsed", "Timelimit", "NodeList", "End")
                rec = dict(zip(keys, f))
                rec["source"] = "sacct"
                return rec
    except SlurmError as e:  # accounting disabled (no slurmdbd): slurmctld's memory instead
        log.debug("sacct: %s", e)
    try:
        out = await run("scontrol", "show", "job", "-o", slurm_id, timeout=30)
    except SlurmError:
        return {}
    rec = {}
    for token in out.split():
        k, sep, v = token.partition("=")
        if sep:
            rec[k] = v
    if "JobState" in rec:
        rec["State"] = rec["JobState"]
        rec["source"] = "scontrol show job"
    return rec


def summary(rec: dict[str, str]) -> str:
    """A record in one line, for the job's reason and events."""
    keys = ("State", "ExitCode", "Reason", "RunTime", "Elapsed", "TimeLimit", "Timelimit", "NodeList", "EndTime", "End")
    return f"{rec.get('source', 'slurm')}: " + ", ".join(f"{k}={rec[k]}" for k in keys if rec.get(k))


async def partition_has_gpus(partition: Optional[str]) -> bool:
    """Whether the partition's nodes have GPUs (sinfo's Gres)."""
    try:
        out = await run("sinfo", "-h", *(["-p", partition] if partition else []), "-o", "%G", timeout=30)
    except SlurmError:
        return False
    return any("gpu" in line for line in out.splitlines())


async def hostnames(nodelist: str) -> list[str]:
    out = await run("scontrol", "show", "hostnames", nodelist, timeout=30)
    return [h for h in out.split() if h]


async def node_address(node: str) -> str:
    """Where the other nodes reach a node (its NodeAddr; the name itself where Slurm has none)."""
    try:
        out = await run("scontrol", "show", "node", "-o", node, timeout=30)
    except SlurmError:
        return node
    for token in out.split():
        k, _, v = token.partition("=")
        if k == "NodeAddr" and v:
            return v
    return node
