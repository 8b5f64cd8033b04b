"""Every tqdm progress bar becomes phase progress: `datasets` .map ("Map: 3200/9488 examples"),
TRL's "Tokenizing train dataset", a script's own loops. tqdm redraws at most every 0.1 s by itself
(refresh); we send at most two events a second per bar, plus the last count when it closes.

Only forward movement is reported: a redraw of a bar whose count did not move (tqdm's monitor
thread redraws stalled bars every 10 s) sends nothing, so it can never look like progress or like a
new phase to the stall detector. Bars are left alone, in every thread of the process, while a
Trainer trains or evaluates (its callback reports phases), and a bar that saw an optimizer step
during its life is a training loop's bar: the optimizer hook (patch_torch.py) counts those steps,
so one step counter results, not two."""
from __future__ import annotations

import threading
import time

from tokenpulse import run

from . import patch_torch

EVERY_S = 0.5
_quiet = [0]  # > 0 while a Trainer's train()/evaluate() runs, in any thread: process-wide, because
_quiet_lock = threading.Lock()  # tqdm's monitor thread redraws the Trainer's bar from another thread


def enter_quiet() -> None:
    with _quiet_lock:
        _quiet[0] += 1


def leave_quiet() -> None:
    with _quiet_lock:
        _quiet[0] = max(0, _quiet[0] - 1)


def is_quiet() -> bool:
    return _quiet[0] > 0


def optimizer_steps() -> int:
    """Optimizer steps of this process so far (0 until torch's optimizer hook is installed)."""
    return patch_torch.STATE.opt_steps


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
    steps = optimizer_steps()
    if not hasattr(bar, "_tp_opt0"):
        bar._tp_opt0 = steps
    if steps != bar._tp_opt0:
        return  # a training loop's bar: the optimizer's steps are the progress
    n = getattr(bar, "n", 0)
    if n == getattr(bar, "_tp_n", None):
        return  # a redraw, not movement (the monitor thread, a refresh of a stalled bar)
    now = time.monotonic()
    if not final and now - getattr(bar, "_tp_sent", 0.0) < EVERY_S:
        return
    em = run.reporter(create=False)
    if em is None:
        return
    bar._tp_sent, bar._tp_n = now, n
    desc = getattr(bar, "desc", "") or ""
    unit = (getattr(bar, "unit", "") or "").strip()
    total = getattr(bar, "total", None)
    try:
        em.phase(phase_name(desc), done=float(n),
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
