"""Data-parallel training across ranks (torch.distributed, started by torchrun).

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; without them (or with
WORLD_SIZE=1) everything here is a no-op and the training process runs alone, as before.

How the maths stays that of one process: every rank builds the same deterministic plan of optimizer
steps (same data, seed and layout; rank 0's choices are broadcast), and each rank takes its share of
a step's micro-batches. The loss of a micro-batch is its summed token loss over the *whole step's*
target count, times the world size: DDP averages gradients over ranks, so the averaged gradient is
exactly the one-process gradient of the step. Ranks with fewer micro-batches than the others run a
zero-weighted copy, because DDP needs the same number of backward passes on every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective that waits longer than this fails the rank (the default NCCL timeout is 10-30 min);
# tokenpulse's agent names a stuck rank long before, and a dying rank's peers fail fast.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("TOKENPULSE_COLLECTIVE_TIMEOUT_S", "600"))
MAX_BROADCAST_BYTES = 1 << 20  # rank 0's choices are a few hundred bytes of JSON


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def on(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def env_ranks() -> Dist:
    """The rank layout torchrun gave this process (rank 0 of 1 when run alone)."""
    return Dist(rank=int(os.environ.get("RANK", "0")), world=int(os.environ.get("WORLD_SIZE", "1")),
                local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def die_with_launcher() -> None:
    """torchrun starts each rank in a session of its own, so a kill of the launcher's group misses
    the ranks: have the kernel kill this rank when its launcher dies (Linux), and let the agent (the
    launcher's parent) read this rank's stacks from outside (Yama ptrace_scope=1)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        launcher = os.getppid()
        if launcher == 1:  # the launcher died before the prctl: do not train as an orphan
            os._exit(1)
        try:  # the agent says who it is (between it and the launcher stands the job's keeper)
            agent = int(os.environ.get("TOKENPULSE_AGENT_PID") or
                        open(f"/proc/{launcher}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            agent = launcher
        libc.prctl(0x59616D61, agent, 0, 0, 0)  # PR_SET_PTRACER: the agent (and its py-spy)
    except (OSError, AttributeError):
        pass


def setup(d: Dist, device: torch.device) -> torch.device:
    """Join the process group: NCCL on GPUs (one per local rank), gloo on CPU. Returns this rank's device."""
    if not d.on:
        return device
    die_with_launcher()
    if device.type == "cuda":
        torch.cuda.set_device(d.local_rank)
        device = torch.device("cuda", d.local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                            **({"device_id": device} if device.type == "cuda" else {}))
    return device


def teardown(d: Dist) -> None:
    if d.on and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def rank_info(d: Dist, device: torch.device) -> dict:
    return {"rank": d.rank, "world_size": d.world, "local_rank": d.local_rank, "host": socket.gethostname(),
            "pid": os.getpid(), "device": str(device)}


def broadcast(d: Dist, obj, as_type=None):
    """Rank 0's value on every rank (measured choices differ between processes: use one).

    Sent as JSON in a byte tensor, never pickled: a rank must not run code another rank sends
    (broadcast_object_list unpickles, so whoever hosts rank 0 could run anything in the others).
    A dataclass travels as its fields; `as_type` rebuilds it on every rank."""
    if not d.on:
        return obj
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if d.main:
        payload = json.dumps(dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj).encode()
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    n = int(size.item())
    if not 0 < n <= MAX_BROADCAST_BYTES:
        raise RuntimeError(f"rank 0 broadcast {n} bytes: not a choice")
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if d.main
           else torch.empty(n, dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=0)
    value = json.loads(buf.cpu().numpy().tobytes().decode())
    return as_type(**value) if as_type is not None and isinstance(value, dict) else value


def agree(d: Dist, *flags: bool) -> tuple[bool, ...]:
    """Any rank's flag, on every rank: a cancel or pause is acted on at the same step everywhere
    (one rank leaving the loop while the others enter a collective would hang them)."""
    if not d.on:
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(x) for x in t.tolist())


def shard(d: Dist, micro: list) -> tuple[list, int]:
    """This rank's micro-batches of a step, and how many of them are zero-weighted fillers.

    Micro-batch k goes to rank k % world; every rank runs ceil(len / world) of them (the short ones
    repeat their first, or the step's first, with weight 0)."""
    if not d.on:
        return micro, 0
    mine = micro[d.rank::d.world]
    per_rank = -(-len(micro) // d.world)
    fill = per_rank - len(mine)
    filler = (mine or micro)[0]
    return mine + [filler] * fill, fill


def sum_over_ranks(d: Dist, values: torch.Tensor) -> torch.Tensor:
    if d.on:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def wrap(d: Dist, model, device: torch.device):
    """DistributedDataParallel around the model (rank 0's weights are broadcast at construction)."""
    if not d.on:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def no_sync(model, last: bool):
    """Gradients are all-reduced on a step's last backward only (DDP's no_sync for the others)."""
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()
