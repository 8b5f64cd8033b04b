"""The process-wide reporter behind the explicit API and the Trainer callback.

Under an agent (TOKENPULSE_EVENT_FD set) it is the job's event pipe; in a script started by hand
with TOKENPULSE_URL (and a token), tokenpulse.init() creates an external job on the server and
reports to it over HTTP (tokenpulse/remote.py); otherwise events are printed to stderr.
Stdlib only: `import tokenpulse` must stay light.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

from tokenpulse.events import Emitter, open_job_pipe

_lock = threading.RLock()
_reporter = None  # an Emitter, or a remote.RemoteRun (same methods)
_alive_started = False
pause_requested = threading.Event()  # SIGUSR2 from the agent: a Trainer callback checkpoints and stops
# A SIGTERM its agent did not announce (a preemption, tokenpulse/control.py): the callback checkpoints
# as for a pause, and the job goes back to the queue instead of pausing. pause_requested is set too.
preempt_requested = threading.Event()
requested: dict = {}  # {"signal": "SIGUSR2" | "SIGTERM", "at": time.time()} of the first checkpoint request
checkpoint_reached = threading.Event()  # the callback reached the step end that saves it (or training ended)
BOUND_ENV = "TOKENPULSE_CHECKPOINT_BOUND_S"  # the requested checkpoint's bound, as for the native process


def _asked(sig: str) -> None:
    """The first checkpoint request: noted, and bounded while a Trainer trains here (a step that never
    ends cannot save: past the bound the process says so and ends; the job falls back to its newest
    recorded checkpoint)."""
    if "at" in requested:
        return
    requested["signal"], requested["at"] = sig, time.time()
    if trainer_training:
        threading.Thread(target=_watch_bound, daemon=True, name="tokenpulse-checkpoint-bound").start()


def _watch_bound() -> None:
    try:
        bound = float(os.environ.get(BOUND_ENV) or 45.0)
    except ValueError:
        bound = 45.0
    if checkpoint_reached.wait(bound) or not trainer_training:
        return
    em = reporter(create=False)
    if em is None:
        return
    sig = requested.get("signal", "")
    step = getattr(em, "step_done", None)
    what = "preempted (SIGTERM not sent by its agent)" if sig == "SIGTERM" else f"checkpoint asked for ({sig})"
    reason = (f"{what}, but no step end was reached within {bound:.0f} s"
              + (f" (stuck after step {step})" if step is not None else "")
              + ": no new checkpoint; resumes from the newest checkpoint the job recorded")
    try:
        em.emit("log", line=reason)
        if sig == "SIGTERM":
            em.emit("state", state="queued", failure="preempted", reason=reason)
        else:
            em.emit("state", state="paused", reason=reason)
    finally:
        sys.stdout.flush()
        os._exit(0)


def reporter(create: bool = True):
    """This process's reporter when it is part of an agent's job (or init() was called), else None."""
    global _reporter
    with _lock:
        if _reporter is None and create:
            fd = open_job_pipe()
            if fd is not None:
                _reporter = Emitter(fd=fd, alive_every=0, from_env=False)
        return _reporter


def start_alive() -> None:
    """One alive thread per process, started by whoever reports first."""
    global _alive_started
    with _lock:
        em = reporter()
        if em is not None and not _alive_started:
            _alive_started = True
            em.start_alive(1.0)


trainer_training = False  # set by TokenPulseCallback while a Trainer trains in this process


def _on_pause(signum, frame) -> None:
    _asked("SIGUSR2")
    pause_requested.set()
    if not trainer_training:
        # A launcher (trl sft, accelerate launch) trains in a child: pass the request down.
        threading.Thread(target=_forward_pause, daemon=True).start()


def _forward_pause() -> None:
    """SIGUSR2 to our child processes that handle it (never to one it would kill: a shell's default
    action for SIGUSR2 is to die). Linux /proc; elsewhere nothing is forwarded."""
    me = os.getpid()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != me:
                continue
            with open(f"/proc/{pid}/status") as f:
                caught = next((int(x.split()[1], 16) for x in f if x.startswith("SigCgt:")), 0)
            if caught & (1 << (signal.SIGUSR2 - 1)):
                os.kill(pid, signal.SIGUSR2)
        except (OSError, ValueError, IndexError):
            continue


_term_before = None  # the SIGTERM handler ours replaced


def _on_term(signum, frame) -> None:
    """The agent's announced SIGTERM (a cancel) does what SIGTERM did before; any other is a
    preemption: checkpoint at the next step end and come back (while a Trainer trains)."""
    from tokenpulse.control import announced_cancel, control_file
    if announced_cancel(control_file()) or not trainer_training:
        before = _term_before if _term_before is not None else signal.SIG_DFL
        signal.signal(signal.SIGTERM, before)
        if callable(before):
            before(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)  # the default action, as if ours had never been there
        return
    _asked("SIGTERM")
    preempt_requested.set()
    pause_requested.set()


def install_term_handler() -> bool:
    """While a Trainer trains under an agent: SIGTERM from outside = checkpoint and come back. Only
    over the default action (a script's own handler wins), only from the main thread."""
    global _term_before
    from tokenpulse.control import control_file
    if not control_file() or threading.current_thread() is not threading.main_thread():
        return False
    try:
        current = signal.getsignal(signal.SIGTERM)
        if current is _on_term:
            return True
        if current not in (signal.SIG_DFL, None) and not getattr(current, "tp_default", False):
            return False  # the script's own handler (ours at exit, instrument/lastwords.py, is chained)
        _term_before = current
        signal.signal(signal.SIGTERM, _on_term)
        return True
    except (ValueError, OSError, AttributeError):
        return False


def remove_term_handler() -> None:
    """Training is over: SIGTERM is what it was before."""
    try:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _on_term:
            signal.signal(signal.SIGTERM, _term_before if _term_before is not None else signal.SIG_DFL)
    except (ValueError, OSError, AttributeError):
        pass


def install_pause_handler() -> bool:
    """SIGUSR2 = pause (what the agent sends). Only over the default action (which kills), so a
    script's own handler wins; only from the main thread (Python's rule for signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        current = signal.getsignal(signal.SIGUSR2)
        if current is _on_pause:
            return True
        if current not in (signal.SIG_DFL, None):
            return False
        signal.signal(signal.SIGUSR2, _on_pause)
        return True
    except (ValueError, OSError, AttributeError):
        return False


# ---- the explicit API ---------------------------------------------------------------------------

def init(name: Optional[str] = None, config: Optional[dict] = None, total_steps: Optional[int] = None,
         stall: Optional[dict] = None):
    """Start reporting. Under an agent: the job's pipe. Started by hand with TOKENPULSE_URL (and
    TOKENPULSE_TOKEN): an external job on that server, watched by a watchdog process; `stall`
    overrides its thresholds (tokenpulse/diagnosis/stall.py StallConfig: floor_s, factor, first_step_s...).
    Else events go to stderr. total_steps makes log() report training progress as step n/total.
    Returns the reporter."""
    global _reporter, _total_steps
    with _lock:
        if total_steps is not None:
            _total_steps = int(total_steps)
        em = reporter()
        if em is None:
            if os.environ.get("TOKENPULSE_URL"):
                from tokenpulse.remote import RemoteRun
                em = RemoteRun.start(name=name or _script_name(), config=config or {}, stall=stall)
            else:
                em = Emitter(fd=None, alive_every=0, from_env=False)
            _reporter = em
        elif name or config:
            em.info(**({"run_name": name} if name else {}), **({"config": config} if config else {}))
    start_alive()
    return em


def _script_name() -> str:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    return os.path.basename(argv0)[:200]


def _current():
    em = reporter()
    return em if em is not None else init()


def log(values: dict, step: Optional[int] = None) -> None:
    """Metrics at a step (default: one past the last logged step). Also the training phase's
    progress (step n/total), at most once a second: what the stall detector and the UI follow."""
    em = _current()
    global _last_step, _phase_t
    if step is None:
        step = _last_step + 1
    step = int(step)
    _last_step = max(_last_step, step)
    em.step_done = step
    em.metrics(step, **{str(k): v for k, v in values.items() if isinstance(v, (int, float))})
    now = time.monotonic()
    if em.phase_name != "training" or now - _phase_t >= 1.0:
        _phase_t = now
        em.phase("training", done=step, total=_total_steps, unit="steps")


_last_step = -1
_phase_t = 0.0
_total_steps: Optional[int] = None


def phase(name: str, done: Optional[float] = None, total: Optional[float] = None,
          unit: Optional[str] = None, detail: Optional[str] = None) -> None:
    _current().phase(name, done=done, total=total, unit=unit, detail=detail)


def alert(message: str, kind: str = "user", severity: str = "warning", clear: bool = False) -> None:
    _current().alert(kind, message, severity=severity, clear=clear)


def finish(state: str = "completed", reason: Optional[str] = None) -> None:
    """End the run: completed (default) or failed. Standalone, this ends the external job (and the
    watchdog sends what is left before it returns); under an agent it is the script's own verdict,
    which the agent weighs with the exit code. Without finish(), a normal exit counts as completed
    and an uncaught exception as failed."""
    global _reporter
    with _lock:
        em = _reporter
        if em is None:
            return
        finish_fn = getattr(em, "finish", None)
        if finish_fn is not None:
            finish_fn(state, reason)
            _reporter = None
        else:
            em.emit("state", state=state, reason=reason)
