"""Measurements kept on disk in the agent's cache dir, so the next attempt of a job (a fix's relaunch,
a retry) and the next job of the same shape on this machine take a measured choice without measuring
again: the loss head's compile-or-not (losshead.py: 4-30 s of compiling and timing on a small CPU;
inductor's own cache keeps the kernels) and CPU precision (precision.py: a few seconds of timing,
whose bf16/fp32 verdict can flip on a noisy machine and so change every later key).

One small JSON file per kind and key, the key everything the measurement depends on plus the host,
its CPU model, the torch threads and torch's and transformers' versions. Written whole (os.replace): a job reading
beside another never sees half a file. A file that cannot be read or written is a miss (the
measurement runs, as without a cache)."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Optional

import torch
import transformers


@functools.cache
def cpu_model() -> str:
    """The CPU's model name: a host name can move to another machine (a cloud VM resized, a container
    rescheduled), and a bf16 timing from a CPU with AMX says nothing of one without."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def key(**parts) -> str:
    """A digest of what a measurement depends on, plus what every measurement here depends on."""
    parts.update(host=socket.gethostname(), cpu=cpu_model(), threads=torch.get_num_threads(),
                 torch=torch.__version__, transformers=transformers.__version__)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def load(cache_dir: Optional[Path], kind: str, k: str) -> Optional[dict]:
    if cache_dir is None:
        return None
    try:
        return json.loads((Path(cache_dir) / kind / f"{k}.json").read_text())
    except (OSError, ValueError):
        return None


def save(cache_dir: Optional[Path], kind: str, k: str, measured: dict) -> None:
    if cache_dir is None:
        return
    d = Path(cache_dir) / kind
    tmp = d / f".{k}.{os.getpid()}.tmp"
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(measured))
        os.replace(tmp, d / f"{k}.json")
    except OSError:  # a read-only or full cache dir: the next attempt measures again
        tmp.unlink(missing_ok=True)
