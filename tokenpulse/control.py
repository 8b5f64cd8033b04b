"""The agent's word before its own SIGTERM (stdlib only: the startup hook, the training process and
the agent read it).

SIGTERM is ambiguous: the agent cancels with it (torchrun forwards only SIGTERM to its ranks), and a
scheduler's preemption or a node drain sends it too. Before its own SIGTERM the agent writes
"cancel" into the file TOKENPULSE_CONTROL_FILE names (one per attempt, emptied at its start, read by
every process of the job on that node). A SIGTERM with that word there is the agent's cancel; any
other came from outside: checkpoint at the next step boundary and come back."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

CONTROL_ENV = "TOKENPULSE_CONTROL_FILE"
CANCEL_WORD = "cancel"
# A warm standby's assignment pipe (worker/agent/warm.py writes the job, worker/training/standby.py reads it).
ASSIGN_ENV = "TOKENPULSE_ASSIGN_FD"


def control_file(environ=None) -> Optional[str]:
    return (os.environ if environ is None else environ).get(CONTROL_ENV) or None


def announced_cancel(path: Optional[str]) -> bool:
    """Did the agent say its SIGTERM is a cancel? Without a control file (a process run alone, not
    by an agent) every SIGTERM is one, as it always was."""
    if not path:
        return True
    try:
        return Path(path).read_text().strip() == CANCEL_WORD
    except OSError:
        return False
