"""A warm standby: tokenpulse's training process forked from the agent's zygote (zygote.py, which ran
`preload`) ahead of its job, with its event pipe (worker/agent/warm.py). It blocks reading its
assignment, one JSON line, from the pipe named by TOKENPULSE_ASSIGN_FD:

    {"argv": [train.py's arguments], "env": {per-attempt variables}}

and train.py's main runs the job with those arguments, in this same process. EOF instead of a line
(the agent closed it, or died): it exits without running anything.

Nothing before the assignment touches a device or runs a torch op: no OpenMP pool, no CUDA context,
no thread of ours; the training code sets its seeds, threads and signal handlers after it, as in a
plain start.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

from tokenpulse.control import ASSIGN_ENV


def preload(cache_dir: Optional[Path]) -> None:
    """What a plain start spends its first seconds importing (nothing here runs a torch op)."""
    from .hub import use_shared_cache
    use_shared_cache(cache_dir)  # HF_HOME before huggingface_hub loads, as train.main does (train.py
    # set the CPU runtime's variables at its import, before this)
    import datasets  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401 -- what the loss head's torch.compile loads first (losshead.py): ~5 s
    import torch._inductor.compile_fx  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401 -- the builtin tiny model's, loaded lazily

    from . import controls, session  # noqa: F401 -- what train.main imports lazily (train.py is __main__)


def wait_assignment(fd: int) -> Optional[dict]:
    """The job, or None when the pipe ended without one."""
    with os.fdopen(fd, "rb") as f:
        line = f.readline()
    return json.loads(line) if line.strip() else None


def wait_for_job() -> Optional[list[str]]:
    """The standby's life before its job (its imports done by its zygote): the assignment read, its
    variables set; train.py's arguments for the job, or None (no job: exit)."""
    job = wait_assignment(int(os.environ.pop(ASSIGN_ENV)))
    if job is None:
        return None
    os.environ.update(job["env"])  # before the training code reads any of it
    sys.argv = [sys.argv[0], *job["argv"]]
    return list(job["argv"])
