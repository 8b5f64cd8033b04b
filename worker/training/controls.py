"""Signals from the agent: cancel, pause, dump stacks."""
from __future__ import annotations

import faulthandler
import signal
import sys


class Controls:
    """SIGTERM = cancel, SIGUSR2 = pause: both only set a flag; the loop acts at a step boundary."""

    def __init__(self):
        self.cancel = False
        self.pause = False

    def install(self) -> "Controls":
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGUSR2, self._on_pause)
        # The agent sends SIGUSR1 to see where a stalled job is: every thread's stack to stderr.
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        return self

    def _on_term(self, signum, frame):
        self.cancel = True

    def _on_pause(self, signum, frame):
        self.pause = True

    def should_stop(self) -> bool:
        return self.cancel

