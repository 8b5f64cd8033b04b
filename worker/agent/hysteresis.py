"""Hysteresis for alert conditions: a condition opens only after it held for `open_s`, and clears only
after it stayed away for `clear_s`. One noisy sample either way changes nothing, so a condition that
flickers around its threshold is one alert, not one per flicker. Pure logic, clock passed in."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

OPEN, CLEAR = "open", "clear"


@dataclass
class Latch:
    open_s: float = 0.0  # the condition must hold this long before it opens
    clear_s: float = 0.0  # ... and stay away this long before it clears
    is_open: bool = False
    since: Optional[float] = None  # when observations started to disagree with the state

    def update(self, holds: bool, now: float) -> Optional[str]:
        """Feed one observation: OPEN or CLEAR on a transition, else None."""
        if holds == self.is_open:
            self.since = None  # agreement resets the other way's clock
            return None
        if self.since is None:
            self.since = now
        if now - self.since >= (self.clear_s if self.is_open else self.open_s):
            self.is_open, self.since = holds, None
            return OPEN if holds else CLEAR
        return None

    def reset(self) -> None:
        self.is_open, self.since = False, None
