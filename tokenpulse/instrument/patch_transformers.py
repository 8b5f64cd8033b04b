"""Patches applied when a job's script imports transformers (never before).

- Trainer.__init__: adds the TokenPulseCallback (TRL's trainers are Trainers, so they get it too).
- Trainer._track_num_input_tokens, called once per micro-batch in the training loop: the callback
  counts real tokens (attention mask or position ids) and padded tokens there.
- Trainer.train: resumes from TOKENPULSE_RESUME_FROM (set by the agent on a resume) when the script
  passed no resume_from_checkpoint, and exits the process after a pause has checkpointed.
- PreTrainedModel.from_pretrained: a "loading model" phase.
"""
from __future__ import annotations

import functools
import os
import threading

from tokenpulse import run

from . import patch_tqdm

RESUME_ENV = "TOKENPULSE_RESUME_FROM"
_resume_used = False
_loading = threading.local()


def find_callback(trainer):
    cached = trainer.__dict__.get("_tp_callback")
    if cached is not None:
        return cached
    from tokenpulse.integrations import TokenPulseCallback
    for cb in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
        if isinstance(cb, TokenPulseCallback):
            trainer.__dict__["_tp_callback"] = cb
            return cb
    return None


def install_trainer(module) -> None:
    install_trainer_class(module.Trainer, auto_callback=True)


def install_trainer_class(Trainer, auto_callback: bool) -> None:
    """Idempotent; TokenPulseCallback calls it too (without the hook) for token counting."""
    if not Trainer.__dict__.get("_tp_patched"):
        Trainer._tp_patched = True
        _patch_counting(Trainer)
        _patch_train(Trainer)
    if auto_callback and not Trainer.__dict__.get("_tp_auto"):
        Trainer._tp_auto = True
        _patch_init(Trainer)


def _patch_init(Trainer) -> None:
    orig = Trainer.__init__

    @functools.wraps(orig)
    def __init__(self, *a, **k):
        orig(self, *a, **k)
        if find_callback(self) is None:
            from tokenpulse.integrations import TokenPulseCallback
            self.add_callback(TokenPulseCallback(trainer_name=type(self).__name__))
    Trainer.__init__ = __init__


def _patch_counting(Trainer) -> None:
    orig = getattr(Trainer, "_track_num_input_tokens", None)
    if orig is not None:
        @functools.wraps(orig)
        def _track_num_input_tokens(self, inputs):
            cb = find_callback(self)
            if cb is not None:
                cb.count_batch(inputs)
            return orig(self, inputs)
        Trainer._track_num_input_tokens = _track_num_input_tokens
        return
    orig_step = Trainer.training_step  # older transformers: one call per micro-batch as well

    @functools.wraps(orig_step)
    def training_step(self, model, inputs, *a, **k):
        cb = find_callback(self)
        if cb is not None:
            cb.count_batch(inputs)
        return orig_step(self, model, inputs, *a, **k)
    Trainer.training_step = training_step


def resume_path():
    """The checkpoint the agent asks this job to continue from, once per process."""
    global _resume_used
    path = os.environ.get(RESUME_ENV)
    if _resume_used or not path or not os.path.isdir(path):
        return None
    _resume_used = True
    return path


def _patch_train(Trainer) -> None:
    orig_train, orig_eval = Trainer.train, Trainer.evaluate

    @functools.wraps(orig_train)
    def train(self, resume_from_checkpoint=None, *a, **k):
        if resume_from_checkpoint in (None, False):
            path = resume_path()
            if path is not None:
                resume_from_checkpoint = path
                em = run.reporter(create=False)
                if em is not None:
                    em.info(resumed_from=path, reason=f"{RESUME_ENV} set by the agent")
        patch_tqdm.enter_quiet()
        try:
            out = orig_train(self, resume_from_checkpoint, *a, **k)
        finally:
            patch_tqdm.leave_quiet()
        cb = find_callback(self)
        if cb is not None and cb.paused:
            # The checkpoint is saved and the agent told: stop the script here, so it does not go on
            # to save a "final" model or evaluate as if training had finished.
            raise SystemExit(0)
        return out

    @functools.wraps(orig_eval)
    def evaluate(self, *a, **k):
        patch_tqdm.enter_quiet()
        try:
            return orig_eval(self, *a, **k)
        finally:
            patch_tqdm.leave_quiet()

    Trainer.train, Trainer.evaluate = train, evaluate


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
