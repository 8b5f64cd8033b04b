"""The command line that starts a job: the training process alone, or torchrun's elastic launcher
around it when the job asks for several processes (nproc_per_node) or machines (nnodes).

torchrun, not a home-made launcher: it sets RANK/WORLD_SIZE/LOCAL_RANK, runs the c10d rendezvous
and tears the local group down when a rank fails. `--max-restarts 0`: a failed rank fails the attempt
and tokenpulse's retry policy (from the newest checkpoint) applies to the job as a whole.
"""
from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tokenpulse.protocol import SpecBase


@dataclass
class Gang:
    """Where this agent's share of a job sits: its node rank and the rendezvous endpoint."""
    node_rank: int = 0
    endpoint: Optional[str] = None  # host:port of node rank 0's rendezvous store
    run_id: str = "tokenpulse"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_distributed(spec: SpecBase) -> bool:
    return spec.nproc_per_node > 1 or spec.nnodes > 1


def launches_ranks(argv: list[str]) -> bool:
    """A command that is itself a torchrun launch, or an `accelerate launch` (which runs torch's
    elastic launcher in its own process): its children are ranks."""
    if not argv:
        return False
    name = Path(argv[0]).name
    return (name == "torchrun" or "torch.distributed.run" in argv[:4]
            or (name == "accelerate" and argv[1:2] == ["launch"]) or "accelerate.commands.launch" in argv[:4])


def training_args(spec_path: Path, out_dir: Path, cache_dir: Path, resume: Optional[str]) -> list[str]:
    args = ["-m", "worker.training.train", "--spec", str(spec_path), "--out", str(out_dir),
            "--cache-dir", str(cache_dir)]
    return args + (["--resume", resume] if resume else [])


def command(spec: SpecBase, train: list[str], gang: Optional[Gang] = None, no_python: bool = False) -> list[str]:
    """argv for the job: `python -u <train>` or `python -u -m torch.distributed.run ... <train>`.
    no_python: `train` is a whole command (a command job's), run as given once per rank."""
    if not is_distributed(spec):
        return [sys.executable, "-u", *train] if not no_python else list(train)
    gang = gang or Gang()
    endpoint = gang.endpoint or f"127.0.0.1:{free_port()}"
    if spec.nnodes > 1:
        # Static rendezvous: the node ranks the server handed out hold (c10d's dynamic rendezvous
        # numbers nodes by arrival, and node rank 0's agent, the one reporting the job, must run
        # global rank 0); node rank 0 hosts the store at its advertised endpoint.
        rdzv = ["--rdzv-backend", "static", "--rdzv-endpoint", endpoint, "--node-rank", str(gang.node_rank)]
    else:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-conf", "is_host=true"]
    return [sys.executable, "-u", "-m", "torch.distributed.run",
            "--nproc-per-node", str(spec.nproc_per_node), "--nnodes", str(spec.nnodes), *rdzv,
            "--rdzv-id", gang.run_id, "--max-restarts", "0", "--monitor-interval", "0.5",
            *(["--no-python"] if no_python else []), *train]
