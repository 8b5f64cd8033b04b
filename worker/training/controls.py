"""Signals from the agent (cancel, pause, dump stacks) and test-only fault injection."""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from typing import Optional

from tokenpulse.protocol import FaultSpec


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


def _fault_hang() -> None:
    """hang_at_step: never returns (the name is what the stall detector's stack capture shows)."""
    while True:
        time.sleep(3600)


class Faults:
    def __init__(self, spec: Optional[FaultSpec]):
        self.spec = spec

    def before_step(self, step: int) -> None:
        f = self.spec
        if f is None:
            return
        if f.crash_at_step is not None and step == f.crash_at_step:
            sys.stderr.write(f"fault injection: crash at step {step}\n")
            sys.stderr.flush()
            os._exit(3)
        if f.hang_at_step is not None and step == f.hang_at_step:
            _fault_hang()
        if f.step_sleep_s:
            time.sleep(f.step_sleep_s)

    def nan_now(self, step: int) -> bool:
        return self.spec is not None and self.spec.nan_at_step is not None and step == self.spec.nan_at_step

    def after_step(self, step: int, step_seconds: float) -> None:
        f = self.spec
        if f is not None and f.slow_after_step is not None and step >= f.slow_after_step:
            time.sleep(step_seconds * (f.slow_factor - 1))
