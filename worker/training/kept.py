"""The loss head's measurement (losshead.py), kept on disk in the agent's cache dir, so the next
attempt of a job (a fix's relaunch, a retry) and the next job of the same model shape on this machine
take the choice without compiling and timing both paths again (4-30 s on a small CPU; inductor's own
cache keeps the compiled kernels).

One small JSON file per key, the key everything the measurement depends on: the model's config and
class, the precision, the device (and the GPU's name), the torch threads, the host, torch's and
transformers' versions. Written whole (os.replace): a job reading beside another never sees half a
file. A file that cannot be read or written is a miss (the measurement runs, as without a cache)."""
from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Optional

import torch
import transformers

DIR = "losshead"  # under the cache dir


def key(config, classes: str, precision: str, device: torch.device) -> str:
    cfg = config.to_dict()
    cfg.pop("_name_or_path", None)  # where the weights came from does not change the speed
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    parts = {"config": cfg, "class": classes, "precision": precision, "device": device.type,
             "gpu": gpu, "threads": torch.get_num_threads(), "host": socket.gethostname(),
             "torch": torch.__version__, "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load(cache_dir: Optional[Path], k: str) -> Optional[dict]:
    if cache_dir is None:
        return None
    try:
        return json.loads((Path(cache_dir) / DIR / f"{k}.json").read_text())
    except (OSError, ValueError):
        return None


def save(cache_dir: Optional[Path], k: str, measured: dict) -> None:
    if cache_dir is None:
        return
    d = Path(cache_dir) / DIR
    tmp = d / f".{k}.{os.getpid()}.tmp"
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(measured))
        os.replace(tmp, d / f"{k}.json")
    except OSError:  # a read-only or full cache dir: the next attempt measures again
        tmp.unlink(missing_ok=True)
