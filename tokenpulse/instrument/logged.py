"""Metrics read from the logging calls a script already makes (patch_loggers.py wraps them), sent as
metrics events that say where each value came from (sources.py).

Each call is read as it happens: the values under their own names (cut to the protocol's 64
characters), at the call's own step when it gives one, else at the step the job has reached. Only
plain numbers and one-element tensors are read (the user's logger converts them anyway). A call made
inside another captured call (Lightning's loggers writing to TensorBoard, Accelerate's trackers
writing to wandb) is the same value said twice: only the outermost is read. Non-finite values go the
Emitter's way (an alert naming the metric). At most MAX_NAMES names a process: past that, one warning.
Nothing here may raise into the user's code: every reading is guarded by its caller.
"""
from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional

from tokenpulse import run

from . import sources

LOGGER = "logger"
MAX_NAMES = 2000
_via: dict[str, str] = {}  # name -> the call that said it ('wandb.log'), as last sent
_inside = threading.local()
_names: set[str] = set()
_warned = [False]


@contextmanager
def outermost() -> Iterator[bool]:
    """True for the outermost captured call on this thread; inner ones are not read again."""
    depth = getattr(_inside, "depth", 0)
    _inside.depth = depth + 1
    try:
        yield depth == 0
    finally:
        _inside.depth = depth


def number(v: Any) -> Optional[float]:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    numel = getattr(v, "numel", None)  # a tensor or numpy scalar: one element only
    if numel is not None and callable(getattr(v, "item", None)):
        try:
            if (numel() if callable(numel) else numel) == 1:
                x = v.item()
                return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None
        except Exception:
            return None
    return None


def current_step() -> int:
    em = run.reporter(create=False)
    step = getattr(em, "step_done", None) if em is not None else None
    if step is None:
        from . import patch_torch
        step = patch_torch.STATE.opt_steps
    return max(0, int(step))


def capture(via: str, values: Mapping[str, Any], step: Optional[Any] = None) -> None:
    """Report these values, said by `via` ('wandb.log'), at `step` (None: the step the job reached)."""
    em = run.reporter(create=False)
    if em is None or not sources.enabled(LOGGER):
        return
    out: dict[str, float] = {}
    for k, v in values.items():
        x = number(v)
        name = str(k)[:64]
        if x is None or not name or not _admit(em, name) or not sources.CLAIMS.allow(name, LOGGER):
            continue
        out[name] = x
    if not out:
        return
    s = number(step) if step is not None else None
    at = int(s) if s is not None and math.isfinite(s) and s >= 0 else current_step()
    new = {k: via for k in out if _via.get(k) != via}
    if new:  # which call said each name, once: the agent folds it into the job's metric_sources
        _via.update(new)
        em.info(metric_via=new)
    em.metrics_from(at, out, LOGGER)


def _admit(em, name: str) -> bool:
    if name in _names:
        return True
    if len(_names) < MAX_NAMES:
        _names.add(name)
        return True
    if not _warned[0]:
        _warned[0] = True
        em.emit("log", stream="stderr",
                line=f"tokenpulse: this process logged more than {MAX_NAMES} metric names; names past the "
                     f"first {MAX_NAMES} are not captured (first left out: {name})")
    return False
