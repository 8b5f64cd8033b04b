"""A command job's last words: at the process's end (a normal end, sys.exit, an uncaught exception,
SIGTERM) its step counter, last losses and last phase are sent before it goes (patch_torch.py's
reports go at most once a second, so the last steps of a process were never sent).

The exit code and signal behaviour stay the script's: atexit runs after Python's own (sys.exit's
code, the traceback); on SIGTERM, only where its action is the default, the events are sent and the
signal is raised again with the default action, so the process still dies of SIGTERM. A script's own
SIGTERM handler, set before or after, wins. The agent reads the pipe to its end before it judges the
exit (worker/agent/job_run.py), so these events arrive before the job's final state.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading

FLUSH_WAIT_S = 2.0  # a signal handler's flush: a main thread caught mid-write cannot hold it longer
_done = False


def flush() -> None:
    global _done
    if _done:
        return
    _done = True
    pt = sys.modules.get("tokenpulse.instrument.patch_torch")
    try:
        if pt is not None:
            pt.flush_final()
    except Exception:
        pass  # never turn the script's end into an error


def _on_term(signum, frame) -> None:
    # from a helper thread: the signal may have caught the main thread inside the pipe's lock
    t = threading.Thread(target=flush, daemon=True, name="tokenpulse-lastwords")
    t.start()
    t.join(FLUSH_WAIT_S)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # the default action, as if ours had never been there


_on_term.tp_default = True  # type: ignore[attr-defined]  # run.install_term_handler may chain over it


def install() -> None:
    atexit.register(flush)
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_term)
    except (ValueError, OSError, AttributeError):
        pass
