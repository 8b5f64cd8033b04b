"""The loss of a script that reports none: the scalar it calls `.backward()` on (source `backward`,
sources.py), for a loop that is not a Trainer and does not call tokenpulse.log.

- Summed over the gradient-accumulation micro-batches between two optimizer steps, so it equals the
  script's own loss (a script that divides each micro-batch's loss by its accumulation steps prints
  that sum).
- GradScaler's scale removed: `scaler.scale(loss)` is remembered with the loss it scaled, and the
  backward of the scaled tensor counts the unscaled one.
- No device synchronisation per step: the values stay detached tensors, added on their device; one
  `.tolist()` reads every step's loss when the step counter reports (at most once a second).
- A loop with no optimizer object (a hand-written update after `loss.backward()`): each backward is
  a step (patch_torch counts it).

Stdlib only at import; torch is touched inside the install functions (boot.py).
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Optional

from .sources import CLAIMS, enabled

MAX_POINTS = 100  # loss points sent per report; more steps than that: every k-th step (k = 1, 2, 5, 10...)
EVERY = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class Losses:
    def __init__(self) -> None:
        self.on = enabled("backward")
        self.acc: Any = None  # this step's micro-batch losses so far (a detached tensor)
        self.pending: list[tuple[int, Any]] = []  # (step, loss tensor) not read yet
        self.scaled: Optional[tuple] = None  # (weakref to GradScaler's output, the loss it scaled)


LOSSES = Losses()


def _patch_torch():
    return sys.modules.get("tokenpulse.instrument.patch_torch")


def _seen(t, args, kwargs) -> None:
    gradient = args[0] if args else kwargs.get("gradient")
    if not LOSSES.on or gradient is not None or t.numel() != 1 or not t.requires_grad:
        return  # not a loss: a vector-Jacobian product, or nothing to learn from
    pt = _patch_torch()
    if pt is None or not pt._owns_steps():
        return  # a Trainer's callback or tokenpulse.log reports the loss
    L = LOSSES
    sc = L.scaled
    v = sc[1] if sc is not None and sc[0]() is t else t.detach()
    v = v.reshape(()).float()  # a no-op for a float32 scalar
    L.acc = v if L.acc is None else L.acc + v


def step_done(step: int) -> None:
    """The optimizer stepped (patch_torch): the micro-batches' sum is this step's loss."""
    L = LOSSES
    if L.acc is not None:
        L.pending.append((step, L.acc))
        L.acc = None


def flush(em) -> None:
    """Every pending step's loss, read in one go (the one synchronisation), sent as metric `loss`."""
    L = LOSSES
    if not L.pending or em is None:
        return
    pending, L.pending = L.pending, []
    if not CLAIMS.allow("loss", "backward"):
        return  # a better source (a logging library, tokenpulse.log) gives this script's loss
    import torch
    dev = pending[0][1].device
    values = torch.stack([v.to(dev) for _, v in pending]).tolist()
    every = next((k for k in EVERY if len(pending) / k <= MAX_POINTS), EVERY[-1])
    last = len(pending) - 1
    for i, ((step, _), v) in enumerate(zip(pending, values)):
        if step % every == 0 or i == last:
            em.metrics_from(step, {"loss": v}, "backward")


def _firststeps():
    from . import firststeps
    return firststeps


def _first_backward() -> bool:
    """The first backward passes timed as they run (firststeps.py)."""
    try:
        f = _firststeps()
        if f.FACTS.running is not None or len(f.FACTS.passes["backward_s"]) >= f.FIRST_PASSES:
            return False
        f.FACTS.pass_begin("backward")
        return True
    except Exception:
        return False


def install_tensor(module) -> None:
    """torch._tensor: Tensor.backward, patched on the class (nothing is left on a user's tensor)."""
    cls = module.Tensor
    if cls.__dict__.get("backward") is None or getattr(cls.backward, "_tp", False):
        return
    orig = cls.backward

    def backward(self, *args, **kwargs):
        try:
            _seen(self, args, kwargs)
        except Exception:
            pass  # reading the loss must never break the script's backward
        timed = _first_backward()
        try:
            out = orig(self, *args, **kwargs)
        finally:
            if timed:
                _firststeps().FACTS.pass_end("backward")
        pt = _patch_torch()
        if pt is not None:
            pt.after_backward()  # a loop with no optimizer: this backward was its step
        return out
    backward.__doc__, backward.__name__, backward._tp = orig.__doc__, orig.__name__, True  # type: ignore[attr-defined]
    cls.backward = backward


def install_scaler(module) -> None:
    """torch.amp.grad_scaler: GradScaler.scale remembers the loss it scaled."""
    cls = module.GradScaler
    if getattr(cls.scale, "_tp", False):
        return
    orig = cls.scale

    def scale(self, outputs):
        out = orig(self, outputs)
        try:
            import torch
            if torch.is_tensor(outputs) and out is not outputs and outputs.numel() == 1:
                LOSSES.scaled = (weakref.ref(out), outputs.detach())
        except Exception:
            pass
        return out
    scale.__doc__, scale.__name__, scale._tp = orig.__doc__, orig.__name__, True  # type: ignore[attr-defined]
    cls.scale = scale
