"""TokenPulseCallback: a transformers TrainerCallback that reports a Trainer's run to tokenpulse.

The zero-code hook adds it to every Trainer (and so to TRL's trainers) of a command job; scripts can
add it themselves: `Trainer(..., callbacks=[TokenPulseCallback()])`. It reports through the
process's reporter (tokenpulse/run.py): the agent's event pipe, or an external job over HTTP.

Metrics (at each Trainer log step): loss, lr, grad_norm, epoch, eval/<name> for evaluation metrics,
tokens_per_s (real tokens, from the attention mask or position ids), padded_tokens_per_s,
padding_frac, samples_per_s, step_time_s, eta_s, rss_mb, cuda_peak_mb; any other number the
trainer logs (TRL's mean_token_accuracy, entropy...) as train/<name>. Phases: training step n/total,
evaluating batch k/n, saving. Pause: SIGUSR2 -> save a checkpoint at the next step end and stop.

Also the Trainer patches the callback relies on (install_trainer_class): real and padded tokens counted
per micro-batch, a resume from TOKENPULSE_RESUME_FROM, the process ended after a pause checkpointed;
the zero-code hook (instrument/patch_transformers.py) applies them with the callback added.

Imports transformers: import this module only where transformers is wanted.
"""
from __future__ import annotations

import functools
import os
import time

import torch
from transformers import TrainerCallback

from tokenpulse import run
from tokenpulse.instrument import patch_tqdm
from tokenpulse.instrument.firststeps import FACTS

FIRST_STEPS = 5  # optimizer steps each reported with their own speed (verdicts from step 1)
STEP_EVERY_S = 5.0  # after those, a step's own speed at most this often between log steps

PHASE_EVERY_S = 1.0
RENAME = {"learning_rate": "lr"}
KEEP = {"loss", "grad_norm", "epoch"}
SUMMARY = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}


def rss_mb() -> float:
    try:
        import psutil
        return psutil.Process().memory_info().rss / 2 ** 20
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def metric_name(key: str) -> str:
    if key.startswith("eval_"):
        return "eval/" + key[5:]
    if key in KEEP:
        return key
    return RENAME.get(key) or (key if "/" in key else "train/" + key)


class TokenPulseCallback(TrainerCallback):
    def __init__(self, reporter=None, trainer_name=None):
        self._reporter = reporter
        self.trainer_name = trainer_name
        self.active = False  # training on this process, and it reports (world process zero)
        self.paused = False
        self.checkpoint = None
        self._reset_window(time.perf_counter(), 0)
        self._phase_t = 0.0
        self._eval_k = 0
        self._max_steps = 0
        self._step_t, self._step_real, self._step_padded, self._step_sent = None, [], 0, 0.0

    @property
    def em(self):
        return self._reporter or run.reporter(create=False) or run.init()

    # ---- counting (called once per micro-batch by the patched Trainer) ----------------------------
    def _reset_window(self, t: float, step: int) -> None:
        self._win_t, self._win_step = t, step
        self._real, self._padded, self._samples = [], 0, []

    def count_batch(self, inputs) -> None:
        if not self.active:
            return
        ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        if not torch.is_tensor(ids):
            return
        mask, pos = inputs.get("attention_mask"), inputs.get("position_ids")
        self._padded += ids.numel()
        self._step_padded += ids.numel()
        FACTS.batch(inputs)  # the first batches' rows: lengths, widths, likely truncated
        # Device tensors are summed lazily (at the next log, where the Trainer syncs anyway), so
        # counting never waits for the accelerator.
        if torch.is_tensor(mask) and mask.shape == ids.shape:
            self._real.append(mask.sum())
            self._samples.append(ids.shape[0])
        elif torch.is_tensor(pos) and pos.shape == ids.shape:  # padding-free: sequences start at 0
            self._real.append(ids.numel())
            self._samples.append((pos == 0).sum())
        else:
            self._real.append(ids.numel())
            self._samples.append(ids.shape[0])
        self._step_real.append(self._real[-1])

    def _step_speed(self, step: int) -> None:
        """One optimizer step's own speed, for the first steps and then now and then: the verdicts
        (padding, batch size, data loading) come from step 1, not from the script's logging interval."""
        now = time.perf_counter()
        t0, self._step_t = self._step_t, now
        real, padded = self._step_real, self._step_padded
        self._step_real, self._step_padded = [], 0
        FACTS.maybe_send(force=step <= FIRST_STEPS)  # the first batches' rows, before any verdict
        if t0 is None or now <= t0 or not (step <= FIRST_STEPS or now - self._step_sent >= STEP_EVERY_S):
            return
        self._step_sent = now
        dt = now - t0
        values = {"step_time_s": dt, "eta_s": max(0, self._max_steps - step) * dt}
        if padded:
            r = self._total(real)
            values.update(tokens_per_s=r / dt, padded_tokens_per_s=padded / dt, padding_frac=1 - r / padded)
        self.em.metrics(step, **values)

    @staticmethod
    def _total(xs) -> float:
        """Python ints plus device counts, the latter in one reduction and one read."""
        ts = [x.reshape(()).to(torch.int64) for x in xs if torch.is_tensor(x)]
        n = sum(x for x in xs if not torch.is_tensor(x))
        if ts:
            n += torch.stack([t.to(ts[0].device) for t in ts]).sum().item()
        return float(n)

    def _speed(self, step: int) -> dict:
        now = time.perf_counter()
        steps, dt = step - self._win_step, now - self._win_t
        out = {}
        if steps > 0 and dt > 0:
            real, padded, samples = self._total(self._real), float(self._padded), self._total(self._samples)
            out = {"step_time_s": dt / steps, "samples_per_s": samples / dt,
                   "eta_s": max(0, self._max_steps - step) * dt / steps}
            if padded:
                out.update(tokens_per_s=real / dt, padded_tokens_per_s=padded / dt,
                           padding_frac=1 - real / padded)
        self._reset_window(now, step)
        return out

    # ---- Trainer events ------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kw):
        from transformers import Trainer
        install_trainer_class(Trainer, auto_callback=False)  # token counting, pause exit, resume

    def on_train_begin(self, args, state, control, **kw):
        self.active = state.is_world_process_zero
        if not self.active:
            return
        em = self.em
        run.start_alive()
        run.trainer_training = True
        pausable = run.install_pause_handler() or run.pause_requested.is_set()
        run.install_term_handler()  # a SIGTERM from outside: checkpoint and come back (preemption)
        self._max_steps = state.max_steps
        FACTS.training_args(args, kw.get("model"))
        em.info(pausable=pausable, trainer=self.trainer_name,
                max_steps=state.max_steps, num_train_epochs=args.num_train_epochs,
                per_device_train_batch_size=args.per_device_train_batch_size,
                gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.learning_rate,
                output_dir=os.path.abspath(args.output_dir) if args.output_dir else None)
        em.step_done = state.global_step
        em.phase("training", done=state.global_step, total=state.max_steps, unit="steps")
        self._reset_window(time.perf_counter(), state.global_step)
        self._phase_t = time.monotonic()
        self._step_t, self._step_real, self._step_padded = time.perf_counter(), [], 0

    def on_step_end(self, args, state, control, **kw):
        if not self.active:
            return
        em = self.em
        step = state.global_step
        em.step_done = step  # the alive thread carries it: progress between log steps
        self._step_speed(step)
        if run.pause_requested.is_set() and not self.paused:
            self.paused = True
            run.checkpoint_reached.set()  # at a step end: the save follows, the bound is met
            control.should_save = True
            control.should_training_stop = True
            em.phase("saving", detail=f"checkpoint at step {step} "
                     f"({'preempted' if run.preempt_requested.is_set() else 'pause'})")
        elif control.should_save:
            em.phase("saving", detail=f"checkpoint at step {step}")
        elif time.monotonic() - self._phase_t >= PHASE_EVERY_S:
            self._phase_t = time.monotonic()
            em.phase("training", done=step, total=state.max_steps, unit="steps")
        return control

    def on_log(self, args, state, control, logs=None, **kw):
        if not self.active or not logs:
            return
        em = self.em
        step = state.global_step
        summary = {k: v for k, v in logs.items() if k in SUMMARY}
        if summary:  # the end-of-training summary: one record, not series
            em.info(trainer_summary=summary)
            return
        values = {}
        for k, v in logs.items():
            if k in SUMMARY or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue  # a NaN/inf stays: the Emitter sends it as its word and alerts
            name = metric_name(k)
            if 0 < len(name) <= 64:
                values[name] = float(v)
        if "loss" in logs:  # a training log: throughput and memory over the steps since the last one
            values.update(self._speed(step))
            values["rss_mb"] = rss_mb()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                values["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
        if values:
            em.metrics(step, **values)
        if "loss" in logs:
            self._phase_t = time.monotonic()
            em.phase("training", done=step, total=state.max_steps, unit="steps")

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kw):
        if not state.is_world_process_zero:
            return
        self._eval_k += 1
        now = time.monotonic()
        if self._eval_k == 1 or now - self._phase_t >= 0.5:
            self._phase_t = now
            try:
                total = float(len(eval_dataloader)) if eval_dataloader is not None else None
            except TypeError:
                total = None
            self.em.phase("evaluating", done=self._eval_k, total=total, unit="batches")

    def on_evaluate(self, args, state, control, **kw):
        if not state.is_world_process_zero:
            return
        self._eval_k = 0
        if self.active:
            self.em.phase("training", done=state.global_step, total=state.max_steps, unit="steps")
            self._reset_window(time.perf_counter(), state.global_step)  # eval time is not step time
            self._step_t = time.perf_counter()

    def on_save(self, args, state, control, **kw):
        if not state.is_world_process_zero:
            return
        path = os.path.abspath(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        if os.path.isdir(path):
            self.checkpoint = path
            asked = {}
            if self.paused and run.requested.get("at"):  # the requested one: measured from its signal
                asked = {"requested": run.requested.get("signal"),
                         "request_s": round(max(0.0, time.time() - run.requested["at"]), 3)}
            self.em.emit("checkpoint", step=state.global_step, path=path, final=False, **asked)
        if self.active and not self.paused:
            self.em.phase("training", done=state.global_step, total=state.max_steps, unit="steps")
            self._reset_window(time.perf_counter(), state.global_step)
            self._step_t = time.perf_counter()

    def on_train_end(self, args, state, control, **kw):
        if not self.active:
            return
        self.active = False
        run.trainer_training = False
        if not self.paused:
            run.remove_term_handler()
        em = self.em
        if self.paused and run.preempt_requested.is_set():  # a SIGTERM from outside: back to the queue
            where = f"; requeued to resume from {self.checkpoint}" if self.checkpoint else "; requeued"
            em.emit("state", state="queued", failure="preempted",
                    reason=f"preempted: SIGTERM not sent by its agent (a scheduler's preemption, a node drain) "
                           f"at step {state.global_step}{where}")
        elif self.paused:
            where = f"; resume from {self.checkpoint}" if self.checkpoint else ""
            em.emit("state", state="paused", reason=f"paused at step {state.global_step}{where}")
        else:
            em.phase("training", done=state.global_step, total=state.max_steps, unit="steps",
                     detail="done")


# ---- the Trainer patches the callback relies on -------------------------------------------------

RESUME_ENV = "TOKENPULSE_RESUME_FROM"
_resume_used = False


def find_callback(trainer):
    cached = trainer.__dict__.get("_tp_callback")
    if cached is not None:
        return cached
    for cb in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
        if isinstance(cb, TokenPulseCallback):
            trainer.__dict__["_tp_callback"] = cb
            return cb
    return None


def install_trainer_class(Trainer, auto_callback: bool) -> None:
    """Idempotent. The startup hook calls it with auto_callback (patch_transformers.install_trainer);
    TokenPulseCallback calls it too (without the hook) for token counting, pause exit and resume."""
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
