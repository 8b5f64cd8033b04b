"""Progress and step anatomy from PyTorch itself, for any script: patched when, and only when, the
script imports torch (see boot.py), so a plain loop, an Accelerate loop or a torchrun DDP script
reports its steps with no code change.

- Steps: torch's global optimizer hook (`register_optimizer_step_post_hook`). Every
  `optimizer.step()` that really runs is a step: gradient-accumulation micro-batches never call it
  (Accelerate's wrapper skips the inner step until gradients sync, GradScaler skips it on inf), so
  they are not counted. Several optimizers in one iteration (a GAN) count once: the first optimizer
  that steps leads, and only its steps count (another one takes the lead when it steps twice while
  the leader does not).
- One step counter per process: a Trainer's global_step (its callback) or the explicit API's
  `tokenpulse.log` step wins when present; this hook then reports only the step anatomy. Otherwise
  it reports phase `training` (done = steps, unit `steps`, at most once a second), sets the step
  the alive thread carries, and every ANATOMY_EVERY_S a metrics event (below).
- Tokens: the batch handed to the model's top-level forward: its `input_ids` (and `attention_mask`),
  else its first integer tensor of shape (batch, sequence) among positional arguments (`model(X, Y)`):
  real and padded tokens per second. The top-level module is found with torch's global forward
  hooks for the first calls only, then watched alone (the global hooks would put every submodule
  call on torch's slow path): kept by identity on our side, its class's __call__ wrapped once.
  Nothing is set on the user's module, so what it saves, copies or prints is unchanged. Forwards
  with gradients off, a second or more after the last optimizer step (or before the first), are an
  evaluation: phase `evaluating`, batches counted.
- Loss: the scalar the script calls `.backward()` on (backward.py), when no Trainer or
  tokenpulse.log reports one. A loop with no optimizer object: each backward is a step.
- At exit, the last step, losses and phase are sent (lastwords.py).
- Anatomy, per rank: seconds per step waiting for the next batch (DataLoader `__next__`, its worker
  processes included), in collectives (torch.distributed's blocking calls, and DDP's gradient
  all-reduce timed by a comm hook registered when the script registered none), and the rest
  (forward, backward, optimizer). Sent as metrics `anatomy/r<rank>/data_s|comm_s|compute_s|step_s`
  every ANATOMY_EVERY_S (not per step), and as the rank's alive extras (the rank table, the
  straggler rule).

Stdlib only at import: torch is touched only inside the install functions, which run after torch's
own modules loaded. Every hook is guarded: instrumentation never breaks the user's loop.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Optional

from tokenpulse import run

from . import backward, firststeps

PHASE_EVERY_S = 1.0  # the training phase's counter, at most this often
ANATOMY_EVERY_S = float(os.environ.get("TOKENPULSE_ANATOMY_EVERY_S", "3") or 3)
EVAL_AFTER_S = 1.0  # forwards without gradients this long after the last optimizer step: evaluation
FIRST_ROWS = 8  # a plain loop's first batches whose rows firststeps measures (a mask's sum: a read each)
DISCOVERY_CALLS = 2  # top-level calls of a module with parameters before it is hooked alone
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
               "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "gather_object")
perf = time.perf_counter


class State:
    """This process's counters. Plain attributes: the hooks run on the training thread; a float
    added from DDP's comm thread at worst loses a sample, never breaks anything."""

    def __init__(self) -> None:
        self.opt_steps = 0  # iterations (the lead optimizer's steps)
        self.lead: Optional[int] = None
        self.others: dict[int, int] = {}  # other optimizers' steps since the leader's last one
        self.last_step_t: Optional[float] = None
        self.phase_t = 0.0
        self.win_t: Optional[float] = None  # the anatomy window: start, steps, seconds in data / comm
        self.win_steps = 0
        self.data_s = 0.0
        self.comm_s = 0.0
        self.real: list = []  # real tokens per training forward (ints or lazy tensor sums)
        self.padded = 0
        self.eval_batches = 0
        self.eval_t = 0.0
        self.in_eval = False
        self.last: dict = {}  # the last window's figures (alive extras)
        self.step_busy: list[float] = []  # this window's steps, each: its seconds less its collective waits
        self.comm_mark = 0.0  # comm_s at the last step: the next step's own collective waits
        self.has_optimizer = False  # an optimizer object was made: its steps are the steps, not backward calls
        self.phase_sent: Optional[tuple] = None  # the last phase event's (name, done)
        self.counted_by_others = False  # a Trainer or tokenpulse.log counted steps here: theirs to the end


STATE = State()
_lock = threading.Lock()


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0") or 0) if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else 0
    except ValueError:
        return 0


def _owns_steps() -> bool:
    """False while a Trainer's callback or the explicit API counts the steps: one counter, theirs."""
    return not run.trainer_training and run._last_step < 0


# ---- optimizer steps ----------------------------------------------------------------------------

def _after_step(opt, args, kwargs) -> None:
    try:
        inner = getattr(opt, "optimizer", None)
        if inner is not None and inner is not opt and hasattr(inner, "param_groups"):
            return  # a wrapper (Accelerate's): its step() runs every micro-batch, the inner one's only on a real step
        s, key = STATE, id(opt)
        if s.lead is None:
            s.lead = key
        if key != s.lead:
            n = s.others.get(key, 0) + 1
            s.others[key] = n
            if n < 2:
                return
            s.lead = key  # it steps on while the leader does not: the loop's optimizer changed
        s.others.clear()
        _count_step()
    except Exception:
        pass


def after_backward() -> None:
    """A loop with no optimizer object updates its weights by hand after each backward: that backward
    was its step (backward.py calls this)."""
    if not STATE.has_optimizer:
        try:
            _count_step()
        except Exception:
            pass


def _count_step() -> None:
    s = STATE
    now = perf()
    if s.last_step_t is not None and s.win_t is not None and not (s.eval_batches and s.in_eval):
        s.step_busy.append(now - s.last_step_t - (s.comm_s - s.comm_mark))  # an evaluation's step: left out
    s.opt_steps += 1
    backward.step_done(s.opt_steps)
    s.win_steps += 1
    s.last_step_t = now
    if s.win_t is None:
        s.win_t = now
        s.data_s = s.comm_s = 0.0  # waits before the first step are setup, not step time
        s.real, s.padded, s.win_steps = [], 0, 0
    if s.eval_batches and s.in_eval:
        # an evaluation ran since the last step: its time and its batches are not step anatomy
        s.win_t, s.win_steps, s.data_s, s.comm_s, s.real, s.padded = now, 0, 0.0, 0.0, [], 0
        if not _owns_steps():
            s.in_eval = False  # the step owner (a Trainer) reports its own phases
    s.eval_batches = 0
    em = run._reporter
    if not _owns_steps():
        s.counted_by_others = True
    elif em is not None:
        em.step_done = s.opt_steps  # the alive thread carries it every second: the step, not a second old
    if s.in_eval or now - s.phase_t >= PHASE_EVERY_S or now - s.win_t >= ANATOMY_EVERY_S:
        _report(now)
    s.comm_mark = s.comm_s


def _report(now: float) -> None:
    em = run.reporter(create=False)
    if em is None:
        return
    s = STATE
    own = _owns_steps()
    if own:
        run.start_alive()  # a rank of a launched job has no alive thread of its own yet
        em.step_done = s.opt_steps
        if s.in_eval or now - s.phase_t >= PHASE_EVERY_S:
            s.phase_t, s.in_eval = now, False
            _phase(em, "training", s.opt_steps, "steps")
            backward.flush(em)  # the steps' losses: one read a report, never one a step
    if now - s.win_t >= ANATOMY_EVERY_S and s.win_steps > 0:
        _emit_window(em, now, own)


def _phase(em, name: str, done: int, unit: str) -> None:
    STATE.phase_sent = (name, done)
    em.phase(name, done=done, unit=unit)


def flush_final() -> None:
    """At the process's end (lastwords.py): its last step, losses and phase, which the once-a-second
    reports may not have sent yet, so a finished job's step is the steps the script ran."""
    s = STATE
    em = run.reporter(create=False)
    if em is None or not _owns_steps() or s.counted_by_others:
        return
    backward.flush(em)
    if s.opt_steps == 0 and not s.eval_batches:
        return
    name, done, unit = ("evaluating", s.eval_batches, "batches") if s.in_eval else ("training", s.opt_steps, "steps")
    if s.phase_sent != (name, done):
        _phase(em, name, done, unit)
    if s.opt_steps:
        em.step_done = s.opt_steps
        now = perf()
        if s.win_t is not None and s.win_steps > 0 and now > s.win_t:
            _emit_window(em, now, True)
        else:
            em.metrics(s.opt_steps)  # no figures left to send: the step itself


def _total(xs) -> float:
    ts = [x for x in xs if not isinstance(x, (int, float))]
    n = float(sum(x for x in xs if isinstance(x, (int, float))))
    if ts:
        import torch
        n += float(torch.stack([t.reshape(()).to(torch.int64).to(ts[0].device) for t in ts]).sum().item())
    return n


def _emit_window(em, now: float, own: bool) -> None:
    s = STATE
    steps, dt = s.win_steps, now - s.win_t
    step_s = dt / steps
    data_s, comm_s = min(s.data_s / steps, step_s), min(s.comm_s / steps, step_s)
    compute_s = max(0.0, step_s - data_s - comm_s)
    r = _rank()
    values = {f"anatomy/r{r}/step_s": step_s, f"anatomy/r{r}/data_s": data_s,
              f"anatomy/r{r}/comm_s": comm_s, f"anatomy/r{r}/compute_s": compute_s}
    rss = _rss_mb()
    if rss is not None:
        values[f"anatomy/r{r}/rss_mb"] = rss  # each rank's own memory: a blow-up names its rank
    # the typical step's own work (the median step): a checkpoint save every 25 steps or a slow first
    # step lifts the window's mean, not the median; the straggler rule judges this (agent ranks.py)
    busy = sorted(s.step_busy)
    s.last = {"step_time_s": step_s, "busy_s": step_s - comm_s, "data_s": data_s, "comm_s": comm_s,
              "compute_s": compute_s, **({"rss_mb": rss} if rss is not None else {}),
              **({"busy_step_s": max(0.0, busy[len(busy) // 2])} if busy else {})}
    s.step_busy = []
    if own and r == 0:
        values["step_time_s"] = step_s
        if rss is not None:
            values["rss_mb"] = rss
        if s.padded:
            real = _total(s.real)
            values.update(tokens_per_s=real / dt, padded_tokens_per_s=s.padded / dt,
                          padding_frac=max(0.0, 1 - real / s.padded))
    step = s.opt_steps if own or em.step_done is None else em.step_done
    s.win_t, s.win_steps, s.data_s, s.comm_s, s.real, s.padded = now, 0, 0.0, 0.0, [], 0
    em.metrics(step, **values)


def _rss_mb() -> Optional[float]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError, IndexError):
        return None


def alive_extra() -> dict:
    """What each alive event carries for the rank table: the last window's step anatomy."""
    return dict(STATE.last)


def install_optimizer(module) -> None:
    if getattr(module, "_tp_hooked", False):
        return
    module._tp_hooked = True
    module.register_optimizer_step_post_hook(_after_step)
    opt_cls = module.Optimizer
    orig_init = opt_cls.__init__

    def __init__(self, *a, **k):
        STATE.has_optimizer = True  # from now on optimizer steps are the steps (not backward calls)
        orig_init(self, *a, **k)
    __init__.__doc__, __init__.__wrapped__ = orig_init.__doc__, orig_init  # type: ignore[attr-defined]
    opt_cls.__init__ = __init__
    em = run.reporter(create=False)
    if em is not None:
        em.alive_extra = alive_extra  # this process's alive events carry its anatomy


# ---- data loading -------------------------------------------------------------------------------

def install_dataloader(module) -> None:
    cls = module._BaseDataLoaderIter
    if cls.__dict__.get("_tp_patched"):
        return
    orig = cls.__next__

    def __next__(self):
        t0 = perf()
        try:
            return orig(self)
        finally:
            STATE.data_s += perf() - t0
    cls.__next__, cls._tp_patched = __next__, True


# ---- collectives ----------------------------------------------------------------------------------

def _timed(fn):
    def collective(*a, **k):  # the name py-spy shows between the caller and torch's function
        t0 = perf()
        try:
            return fn(*a, **k)
        finally:
            STATE.comm_s += perf() - t0
    collective.__wrapped__, collective.__name__, collective.__doc__ = fn, fn.__name__, fn.__doc__
    return collective


def install_collectives(module) -> None:
    if getattr(module, "_tp_patched", False):
        return
    module._tp_patched = True
    for name in COLLECTIVES:
        fn = getattr(module, name, None)
        if callable(fn):
            setattr(module, name, _timed(fn))
    dist = __import__("sys").modules.get("torch.distributed")
    if dist is not None:  # already re-exported: point those names at the timed functions too
        for name in COLLECTIVES:
            if hasattr(dist, name) and hasattr(module, name):
                setattr(dist, name, getattr(module, name))


def install_ddp(module) -> None:
    DDP = module.DistributedDataParallel
    if DDP.__dict__.get("_tp_patched"):
        return
    DDP._tp_patched = True
    orig_init, orig_call = DDP.__init__, DDP.__call__
    fresh: dict[int, object] = {}  # id -> weak reference: DDP instances not called yet (nothing set on them)

    def __init__(self, *a, **k):
        orig_init(self, *a, **k)
        try:
            import weakref
            key = id(self)
            fresh[key] = weakref.ref(self, lambda _, k=key: fresh.pop(k, None))
        except Exception:
            pass

    def __call__(self, *a, **k):
        ref = fresh.pop(id(self), None)
        if ref is not None and ref() is self:
            _ddp_first_forward(self)
        return orig_call(self, *a, **k)
    DDP.__init__, DDP.__call__ = __init__, __call__


def _ddp_first_forward(ddp) -> None:
    """Before DDP's first forward (after the script had its chance to register its own comm hook):
    time the gradient all-reduce with the default hook's exact equivalent."""
    try:
        if getattr(ddp, "_comm_hooks", None) or not hasattr(ddp, "reducer"):
            return  # the script registered its own: it stays theirs
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def timed_allreduce(process_group, bucket):
            t0 = perf()
            fut = allreduce_hook(process_group, bucket)

            def done(f):
                STATE.comm_s += perf() - t0
                return f.value()
            return fut.then(done)
        ddp.register_comm_hook(ddp.process_group, timed_allreduce)
    except Exception:
        pass


# ---- the model's top-level forward ------------------------------------------------------------------

_depth = threading.local()
_seen: dict[int, list] = {}  # id(module) -> [module, top-level calls]
_global_handles: list = []


def _g_pre(module, args) -> None:
    d = getattr(_depth, "d", 0)
    _depth.d = d + 1
    if d:
        return
    try:
        if not any(True for _ in module.parameters()):
            return  # a loss function: not the model
        entry = _seen.setdefault(id(module), [module, 0])
        entry[1] += 1
        _model_forward(module, args, {})
        _first_pass(args, {})
        if entry[1] >= DISCOVERY_CALLS:
            _settle()
    except Exception:
        pass


def _g_post(module, args, out) -> None:
    _depth.d = max(0, getattr(_depth, "d", 1) - 1)
    if _depth.d == 0:
        firststeps.FACTS.pass_end("forward")


def _first_pass(args, kwargs) -> bool:
    """The first training forwards (gradients on, even with the model left in eval mode, as
    from_pretrained leaves it): a plain loop's batch rows, and each forward timed as it runs
    (firststeps.py: a step of minutes judged before it ends). True: this forward is being timed."""
    import torch
    facts = firststeps.FACTS
    if not torch.is_grad_enabled():
        return False
    if not run.trainer_training and facts.batches < FIRST_ROWS:
        ids, mask = _token_ids(args, kwargs)  # a Trainer hands its batches to firststeps itself
        if ids is not None:
            facts.batch({"input_ids": ids, "attention_mask": mask})
    if facts.running is not None or len(facts.passes["forward_s"]) >= firststeps.FIRST_PASSES:
        return False
    facts.pass_begin("forward")
    return True


def _settle() -> None:
    """The model is known: watch it (and any other top-level module seen) alone, drop the global hooks."""
    with _lock:
        if not _global_handles:
            return
        for h in _global_handles:
            h.remove()
        _global_handles.clear()
        _depth.d = 0
        for module, _ in _seen.values():
            try:
                _watch(module)
                _watch_inner(module)
            except Exception:
                pass
        _seen.clear()


# Watched modules, by identity, on our side only: nothing is set on the user's module (no hook, no
# attribute), so what the script saves, copies or prints is what it would be without tokenpulse.
# Their classes' __call__ is wrapped once; an instance not watched goes straight to torch's.
_watched: dict[int, object] = {}  # id(module) -> a weak reference to it
_patched: set = set()  # the classes whose __call__ is wrapped
_inside = threading.local()  # .on while a watched module's call runs: a watched module inside it is not another batch


def _watch(module) -> None:
    import weakref
    key = id(module)
    _watched[key] = weakref.ref(module, lambda _, k=key: _watched.pop(k, None))
    _patch_class(type(module))


def _watch_inner(wrapper) -> None:
    """A wrapper (DDP, DataParallel) trains through its forward, but a script often evaluates its inner
    model directly (`evaluate(model.module)`): that module is watched too, so an evaluation is seen as
    one (not as a pause every N steps), and counted once when it does go through the wrapper."""
    import torch
    inner = getattr(wrapper, "module", None)
    if isinstance(inner, torch.nn.Module) and inner is not wrapper and id(inner) not in _watched:
        _watch(inner)


def _patch_class(cls) -> None:
    if cls in _patched:
        return
    _patched.add(cls)
    orig = cls.__call__

    def __call__(self, *args, **kwargs):
        ref = _watched.get(id(self))
        if ref is None or ref() is not self or getattr(_inside, "on", False):
            return orig(self, *args, **kwargs)  # not watched, or inside a watched call (a wrapper's inner module)
        _model_forward(self, args, kwargs)
        try:
            timed = _first_pass(args, kwargs)
        except Exception:
            timed = False
        _inside.on = True
        try:
            return orig(self, *args, **kwargs)
        finally:
            _inside.on = False
            if timed:
                firststeps.FACTS.pass_end("forward")
    __call__.__wrapped__ = orig  # type: ignore[attr-defined]
    cls.__call__ = __call__


def _token_ids(args, kwargs):
    """The batch's token ids and attention mask: `input_ids=` (or a dict of them), else the first
    integer tensor of shape (batch, sequence) among the positional arguments (`model(X, Y)`)."""
    import torch
    batch = kwargs if "input_ids" in kwargs else (args[0] if args and hasattr(args[0], "get") else None)
    if batch is not None:
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    else:
        ids = next((a for a in args if torch.is_tensor(a) and a.dim() == 2 and not a.is_floating_point()
                    and not a.is_complex() and a.dtype != torch.bool), None)
        mask = kwargs.get("attention_mask")
    return (ids, mask) if torch.is_tensor(ids) else (None, None)


def _model_forward(module, args, kwargs):
    try:
        import torch
        s = STATE
        if not torch.is_grad_enabled() or (s.opt_steps == 0 and not getattr(module, "training", True)):
            _eval_batch(s)  # no gradients, or a model in eval mode before any step: an evaluation
            return None
        ids, mask = _token_ids(args, kwargs)
        if ids is None:
            return None
        s.padded += ids.numel()
        s.real.append(mask.sum() if torch.is_tensor(mask) and mask.shape == ids.shape else ids.numel())
    except Exception:
        pass
    return None


def _eval_batch(s: State) -> None:
    s.eval_batches += 1
    now = perf()
    if s.last_step_t is not None and now - s.last_step_t < EVAL_AFTER_S:
        return  # a forward without gradients inside a training iteration (a GAN's, a teacher's)
    if now - s.eval_t < 0.5 and s.in_eval:
        return
    # marked whoever counts the steps: an evaluation's data waits are not the next step's anatomy
    # (a Trainer's evaluation read as 61% of each step waiting for data)
    s.eval_t, s.in_eval = now, True
    em = run.reporter(create=False)
    if em is None or not _owns_steps():
        return
    _phase(em, "evaluating", s.eval_batches, "batches")


def install_forward(module) -> None:
    if getattr(module, "_tp_hooked", False):
        return
    module._tp_hooked = True
    import warnings
    # torch.compile warns of global hooks at each call while ours find the model (the first 2 calls):
    # the script's output must not change because it is watched
    warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks",
                            category=UserWarning)
    _global_handles.append(module.register_module_forward_pre_hook(_g_pre))
    _global_handles.append(module.register_module_forward_hook(_g_post, always_call=True))
