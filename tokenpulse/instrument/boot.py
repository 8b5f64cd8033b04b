"""What the startup hook does in each Python process of a command job (see __init__.py)."""
from __future__ import annotations

import faulthandler
import os
import signal
import sys

from tokenpulse import run
from tokenpulse.events import PIPE_ID_ENV

from .imports import when_imported

_started = False


def start() -> None:
    global _started
    if _started:
        return
    first = not os.environ.get(PIPE_ID_ENV)  # the job's first Python process (not a worker it started)
    em = run.reporter()
    if em is None:
        return  # not really part of a job (the descriptor is not the job's pipe)
    _started = True
    # The agent sends SIGUSR1 to see where a stalled job is when py-spy cannot attach: every
    # thread's stack to stderr, which the agent reads (as for the native training process).
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, RuntimeError, OSError):
        pass
    run.install_pause_handler()  # in every process: a launcher passes a pause down to its trainer
    if first:
        run.start_alive()
        argv = " ".join(sys.argv) if sys.argv and sys.argv[0] else "python"
        em.emit_data("phase", {"name": "running", "detail": argv[:1000]})
        em.phase_name = "running"
    from . import backward, firststeps, lastwords, patch_loggers, patch_torch, patch_tqdm, patch_transformers
    lastwords.install()  # the last step, losses and phase, sent at the process's end
    # torch's own modules, each patched right after it loads (progress and step anatomy, patch_torch.py)
    when_imported("torch.optim.optimizer", patch_torch.install_optimizer)
    when_imported("torch._tensor", backward.install_tensor)  # the loss the script calls .backward() on
    when_imported("torch.amp.grad_scaler", backward.install_scaler)
    when_imported("torch.nn.modules.module", patch_torch.install_forward)
    when_imported("torch.utils.data.dataloader", patch_torch.install_dataloader)
    when_imported("torch.distributed.distributed_c10d", patch_torch.install_collectives)
    when_imported("torch.nn.parallel.distributed", patch_torch.install_ddp)
    when_imported("tqdm.std", patch_tqdm.install)
    when_imported("transformers.trainer", patch_transformers.install_trainer)
    when_imported("transformers.modeling_utils", patch_transformers.install_loading)
    # tokenizer calls: padding, max_length, truncation and the lengths they make (firststeps.py)
    when_imported("transformers.tokenization_utils_base", firststeps.install_tokenizer)
    when_imported("datasets.arrow_dataset", firststeps.install_datasets)  # lengths of tokenized columns
    when_imported("torch.utils.data.dataloader", firststeps.install_dataloader)  # batch size, workers
    patch_loggers.register()  # wandb, TensorBoard, MLflow, Lightning, Accelerate, trackio: their logging calls
