"""Patches applied when a job's script imports transformers (never before).

- transformers.trainer: the Trainer patches of tokenpulse/integrations.py (install_trainer_class),
  with the TokenPulseCallback added to every Trainer (TRL's trainers are Trainers, so they get it too).
  Imported only then: integrations.py loads torch and transformers, this module is loaded by the
  startup hook of every Python process of a command job.
- PreTrainedModel.from_pretrained: a "loading model" phase.
"""
from __future__ import annotations

import functools
import threading

from tokenpulse import run

_loading = threading.local()


def install_trainer(module) -> None:
    from tokenpulse.integrations import install_trainer_class
    install_trainer_class(module.Trainer, auto_callback=True)


def install_loading(module) -> None:
    PreTrainedModel = module.PreTrainedModel
    if PreTrainedModel.__dict__.get("_tp_patched"):
        return
    PreTrainedModel._tp_patched = True
    orig = PreTrainedModel.from_pretrained.__func__

    @functools.wraps(orig)
    def from_pretrained(cls, name_or_path=None, *a, **k):
        em = run.reporter(create=False)
        depth = getattr(_loading, "depth", 0)
        if em is None or depth:
            return orig(cls, name_or_path, *a, **k)
        detail = str(name_or_path)[:500]
        em.phase("loading model", detail=detail)
        _loading.depth = depth + 1
        try:
            model = orig(cls, name_or_path, *a, **k)
        finally:
            _loading.depth = depth
        try:
            n = sum(p.numel() for p in model.parameters())
            em.phase("loading model", done=1, total=1, detail=f"{detail}: {n:,} parameters")
        except Exception:
            pass
        return model
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
