"""Signals from the agent (and from outside): cancel, pause, preemption, dump stacks.

SIGTERM is ambiguous: the agent cancels with it (torchrun forwards only SIGTERM to its ranks), and a
scheduler's preemption or a node drain (`kill -TERM <pid>`) sends it too. The agent announces its own:
before it signals, it writes "cancel" into the file named by TOKENPULSE_CONTROL_FILE (one file per
attempt, read by every rank of the node, torchrun's included). A SIGTERM with that word there is a
cancel; any other is a preemption: checkpoint at the next step boundary, exit `queued`
(EXIT_PREEMPTED), and the job comes back from that checkpoint. Run alone (no control file), SIGTERM
stays a cancel.

A requested checkpoint (pause or an agent's stop: SIGUSR2; a preemption: SIGTERM) is bounded: if the
loop has not reached a step boundary within TOKENPULSE_CHECKPOINT_BOUND_S (default 45 s: within the
agent's 60 s grace for its stop, so the word arrives before a SIGKILL) of the signal,
a watchdog thread says so and ends the process (`on_overdue`): the job falls back to the newest saved
checkpoint."""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

from tokenpulse.control import CONTROL_ENV, announced_cancel

BOUND_ENV = "TOKENPULSE_CHECKPOINT_BOUND_S"
DEFAULT_BOUND_S = 45.0


class Controls:
    """SIGTERM = cancel when announced, else preempt; SIGUSR2 = pause: each only sets a flag (and, for
    a requested checkpoint, starts its bound); the loop acts at a step boundary."""

    def __init__(self, environ=None):
        environ = os.environ if environ is None else environ
        self.cancel = False
        self.pause = False
        self.preempt = False
        self.control_file = environ.get(CONTROL_ENV) or None
        self.bound_s = float(environ.get(BOUND_ENV) or DEFAULT_BOUND_S)
        self.requested: Optional[str] = None  # the signal that asked for a checkpoint: SIGUSR2 | SIGTERM
        self.requested_at: Optional[float] = None  # when it arrived (wall clock)
        self.boundary = threading.Event()  # the loop reached its step boundary (or ended): no overdue
        # (signal name, seconds since the request): no step boundary within bound_s; must not return
        self.on_overdue: Optional[Callable[[str, float], None]] = None

    def install(self) -> "Controls":
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGUSR2, self._on_pause)
        # The agent sends SIGUSR1 to see where a stalled job is: every thread's stack to stderr.
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        return self

    def _on_term(self, signum, frame):
        if announced_cancel(self.control_file):
            self.cancel = True
        else:
            self.preempt = True
            self._asked("SIGTERM")

    def _on_pause(self, signum, frame):
        self.pause = True
        self._asked("SIGUSR2")

    def _asked(self, name: str) -> None:
        if self.requested_at is not None:
            return
        self.requested, self.requested_at = name, time.time()
        if self.on_overdue is not None:
            threading.Thread(target=self._watch, daemon=True, name="tokenpulse-checkpoint-bound").start()

    def _watch(self) -> None:
        if self.boundary.wait(self.bound_s) or self.cancel or self.on_overdue is None:
            return
        self.on_overdue(self.requested or "", time.time() - (self.requested_at or time.time()))

    def request_s(self) -> Optional[float]:
        """Seconds since the requested checkpoint's signal, or None when none was asked for."""
        return None if self.requested_at is None else max(0.0, time.time() - self.requested_at)

    def should_stop(self) -> bool:
        return self.cancel or self.preempt
