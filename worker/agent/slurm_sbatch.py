"""What the Slurm executor (slurm_executor.py) asks of sbatch for one attempt: the options (nodes,
GPUs or CPUs per node, partition, account, QoS, memory, time limit, the warning signal, the job's
name and comment that let a restarted executor find it) and the batch script that srun's one node
process per node (slurm_node.py). The seam: what a submission is, apart from when the executor
submits, watches and settles it."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

from tokenpulse.protocol import Claim
from worker.agent import slurm_cli

ROOT = Path(__file__).resolve().parents[2]  # the tokenpulse checkout the node processes import


class Sbatch:
    def __init__(self, tag: str, partition: Optional[str], account: Optional[str], sbatch_args: list[str]):
        self.tag, self.partition, self.account, self.sbatch_args = tag, partition, account, sbatch_args
        self.gpus: dict[Optional[str], bool] = {}  # partition -> has GPUs (asked once)

    async def options(self, claim: Claim, attempt_dir: Path) -> list[str]:
        """sbatch's options for one attempt: its size, place and time from the spec's `slurm` fields."""
        spec = claim.spec
        want = spec.slurm
        partition = (want.partition if want and want.partition else None) or self.partition
        account = (want.account if want and want.account else None) or self.account
        if partition not in self.gpus:
            self.gpus[partition] = await slurm_cli.partition_has_gpus(partition)
        gpus = want.gpus_per_node if want and want.gpus_per_node is not None else (
            spec.nproc_per_node if self.gpus[partition] else 0)
        cpus = want.cpus_per_node if want and want.cpus_per_node else (spec.nproc_per_node if not gpus else None)
        opts = [f"--job-name=tp-{claim.job_id}.{claim.attempt}", f"--comment={self.tag}:{claim.job_id}:{claim.attempt}",
                f"--nodes={spec.nnodes}", "--ntasks-per-node=1", f"--chdir={attempt_dir}",
                f"--output={attempt_dir}/slurm-%j.out", "--no-requeue", "--export=ALL",
                f"--signal=B:USR2@{want.signal_before_s if want else 120}"]
        if cpus:
            opts.append(f"--cpus-per-task={cpus}")
        if gpus:
            opts.append(f"--gpus-per-node={gpus}")
        if partition:
            opts.append(f"--partition={partition}")
        if account:
            opts.append(f"--account={account}")
        if want and want.qos:
            opts.append(f"--qos={want.qos}")
        if want and want.mem_gb:
            opts.append(f"--mem={max(1, int(want.mem_gb * 1024))}M")
        if want and want.time_limit_min:
            opts.append(f"--time={want.time_limit_min}")
        return opts + self.sbatch_args


def batch_script(attempt_dir: Path) -> str:
    """The batch script: one node process per allocated node, Slurm's warning kept as a file."""
    node = shlex.join([sys.executable, "-u", "-m", "worker.agent.slurm_node", str(attempt_dir)])
    return f"""#!/bin/bash
# tokenpulse: one node process per allocated node (worker/agent/slurm_node.py)
export PYTHONPATH={shlex.quote(str(ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}
# Slurm's warning before the end (--signal=B:USR2) reaches this shell alone: the node processes see it as a file
trap 'touch {shlex.quote(str(attempt_dir / "warned"))}' USR2
srun --kill-on-bad-exit=1 --ntasks-per-node=1 {node} &
pid=$!
while true; do
  wait $pid
  rc=$?
  kill -0 $pid 2>/dev/null || exit $rc
done
"""
