"""Every tqdm progress bar becomes phase progress: `datasets` .map ("Map: 3200/9488 examples"),
TRL's "Tokenizing train dataset", a script's own loops. tqdm redraws at most every 0.1 s by itself
(refresh); we send at most two events a second per bar, plus the last count when it closes.
While a Trainer trains or evaluates, its callback reports phases and its own bars are left alone."""
from __future__ import annotations

import threading
import time

from tokenpulse import run

EVERY_S = 0.5
quiet = threading.local()  # quiet.depth > 0 while a Trainer's train()/evaluate() runs in this thread


def is_quiet() -> bool:
    return getattr(quiet, "depth", 0) > 0


def phase_name(desc: str) -> str:
    d = (desc or "").strip().rstrip(":").strip()
    low = d.lower()
    if "tokeniz" in low:
        return "tokenizing"
    if low.startswith("map"):
        return "mapping"
    if low.startswith("filter"):
        return "filtering"
    if low.startswith(("writing model", "saving")):
        return "saving"
    return low[:60] or "progress"


def report(bar, final: bool) -> None:
    if is_quiet():
        return
    now = time.monotonic()
    if not final and now - getattr(bar, "_tp_sent", 0.0) < EVERY_S:
        return
    em = run.reporter(create=False)
    if em is None:
        return
    bar._tp_sent = now
    desc = getattr(bar, "desc", "") or ""
    unit = (getattr(bar, "unit", "") or "").strip()
    total = getattr(bar, "total", None)
    try:
        em.phase(phase_name(desc), done=float(getattr(bar, "n", 0)),
                 total=float(total) if isinstance(total, (int, float)) and total > 0 else None,
                 unit=None if unit in ("", "it") else unit[:40], detail=desc.strip().rstrip(":")[:200] or None)
    except Exception:
        pass  # a progress bar must never break the loop it counts


def install(module) -> None:
    cls = module.tqdm
    if getattr(cls, "_tp_patched", False):
        return
    orig_refresh, orig_close = cls.refresh, cls.close

    def refresh(self, *a, **k):
        r = orig_refresh(self, *a, **k)
        report(self, final=False)
        return r

    def close(self):
        closing = not getattr(self, "disable", True) and not getattr(self, "_tp_closed", False)
        r = orig_close(self)
        if closing:
            self._tp_closed = True
            report(self, final=True)
        return r

    cls.refresh, cls.close, cls._tp_patched = refresh, close, True
