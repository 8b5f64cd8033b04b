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

import functools
import importlib
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
    from transformers.models.auto import tokenization_auto  # noqa: F401 -- AutoTokenizer's, lazily: ~1 s
    from transformers.models.llama import modeling_llama  # noqa: F401 -- the builtin tiny model's, loaded lazily

    from . import controls, session  # noqa: F401 -- what train.main imports lazily (train.py is __main__)
    try:  # the first from_pretrained builds transformers' checkpoint-renaming table (~1,000 regexes: ~0.7 s)
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without it
        return
    get_checkpoint_conversion_mapping("llama")


# What torch.compile's first call imports lazily (listed from sys.modules around a first compile; a
# name another torch version lacks is skipped)
COMPILE_MODULES = ("torch._dynamo.backends.inductor", "torch._functorch._aot_autograd.subclass_codegen",
                   "torch._inductor.codegen.cpp_wrapper_cpu", "torch._inductor.codegen.memory_planning",
                   "torch.export._trace", "torch.fx.experimental.validator", "sympy.combinatorics",
                   "sympy.tensor.tensor")


def warm_compiler() -> None:
    """What inductor's first compile in a process spends before any kernel of its own (~2-5 s on 2
    busy cores): its lazy imports, probing the CPU's vector instruction sets (a test library built or
    found in its cache, then loaded by child Pythons) and hashing torch's sources, each kept for the
    process (and so for each fork of the zygote that ran it). A relaunch whose kept loss-head choice
    is the compiled one (losshead.py) then compiles from inductor's cache alone. No torch op runs
    here, no thread starts: child processes only, ended before it returns."""
    from torch._inductor import codecache, cpu_vec_isa
    for part in (*[functools.partial(importlib.import_module, name) for name in COMPILE_MODULES],
                 cpu_vec_isa.valid_vec_isa_list, codecache.torch_key):
        try:
            part()
        except ImportError:  # a module another torch version lacks
            pass


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
