"""Zero-code instrumentation of a command job's Python processes.

How it is injected: the agent prepends hook_dir() to the job's PYTHONPATH. That directory holds
only a `sitecustomize.py`, which Python's `site` module imports at every interpreter start (also in
subprocesses, torchrun/accelerate workers and spawned dataloader workers, since they inherit the
environment). It does nothing unless TOKENPULSE_EVENT_FD names the job's event pipe, and nothing
when TOKENPULSE_INSTRUMENT=0 (or the job says `instrument: false`, so the agent leaves the
directory out). It then chains to any other sitecustomize on the path, so a site's own keeps
working. Python started with -S or -I skips sitecustomize (and PYTHONPATH), so it is not
instrumented.

What it does (tokenpulse/instrument/boot.py): an alive thread and a faulthandler stack dump on
SIGUSR1, as the native training process has, and import hooks that patch `transformers.Trainer`
(the TokenPulseCallback, token counting, pause and resume), `from_pretrained` (a loading phase) and
`tqdm` (every progress bar, so `datasets` .map too, becomes phase progress) when, and only when, the
script imports them: a script that never imports transformers pays nothing for it.
"""
from __future__ import annotations

import os
from pathlib import Path

DISABLE_ENV = "TOKENPULSE_INSTRUMENT"


def hook_dir() -> str:
    """The directory to prepend to a command job's PYTHONPATH to instrument it."""
    return str(Path(__file__).resolve().parent / "hook")


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
