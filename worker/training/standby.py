"""A warm standby: tokenpulse's training process started ahead of its job, under its own keeper, with
its event pipe, by the agent (worker/agent/warm.py). It imports torch, transformers, datasets and the
training code, then blocks reading its assignment, one JSON line, from the pipe named by
TOKENPULSE_ASSIGN_FD:

    {"argv": [train.py's arguments], "env": {per-attempt variables}}

and runs train.main(argv) as `python -m worker.training.train` would, in this same process. EOF
instead of a line (the agent closed it, or died): it exits without running anything.

Nothing before the assignment touches a device or runs a torch op: no OpenMP pool, no CUDA context,
no thread of ours; the training code sets its seeds, threads and signal handlers after it, as in a
plain start.

    python -u -m worker.training.standby --cache-dir DIR
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

from tokenpulse.control import ASSIGN_ENV

from .runtime import configure as _configure_runtime

_configure_runtime()  # before anything imports torch (preload), as train.py does


def preload(cache_dir: Optional[Path]) -> None:
    """What a plain start spends its first seconds importing (nothing here runs a torch op)."""
    from .hub import use_shared_cache
    use_shared_cache(cache_dir)  # HF_HOME before huggingface_hub loads, as train.main does
    import datasets  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401 -- the builtin tiny model's, loaded lazily

    from . import session, train  # noqa: F401


def wait_assignment(fd: int) -> Optional[dict]:
    """The job, or None when the pipe ended without one."""
    with os.fdopen(fd, "rb") as f:
        line = f.readline()
    return json.loads(line) if line.strip() else None


def main(argv: list[str]) -> int:
    cache_dir = Path(argv[argv.index("--cache-dir") + 1]) if "--cache-dir" in argv else None
    fd = int(os.environ.pop(ASSIGN_ENV))
    preload(cache_dir)
    job = wait_assignment(fd)
    if job is None:
        return 0
    os.environ.update(job["env"])  # before the training code reads any of it
    sys.argv = ["-m worker.training.train", *job["argv"]]
    from .train import main as train_main
    return train_main(job["argv"])


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as train.py: no slow teardown of torch/datasets
