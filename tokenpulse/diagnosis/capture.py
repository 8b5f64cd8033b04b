"""The one stack-capture ladder: every thread's Python stack of a process, read the best way its
state allows. The agent (a job it runs) and the watchdog (a script started by hand) both climb it;
each hands in how it gets the process's own faulthandler dump (the agent reads the job's stderr,
the watchdog the script's stack file).

In order: py-spy (suspends the process for a consistent read); the process's faulthandler on
SIGUSR1 (it must run its own handler, so only when it can); py-spy --nonblocking (reads a process
that cannot be suspended: already stopped, traced, or frozen in I/O). TOKENPULSE_STACK_TOOL=
faulthandler tries faulthandler first; py-spy --nonblocking stays the fallback when the process could
not answer (a frozen one writes an empty dump that names nothing)."""
from __future__ import annotations

import os
from typing import Awaitable, Callable, Optional

from tokenpulse.diagnosis.stacks import can_run_handlers, describe_state, find_py_spy, process_state, py_spy_dump

# Sends the process SIGUSR1 and returns what its faulthandler wrote ("" when nothing came).
FaulthandlerDump = Callable[[], Awaitable[str]]


def is_stack(text: str) -> bool:
    """A faulthandler dump names at least one frame ('  File "x.py", line 3 in f')."""
    return any(line.lstrip().startswith("File ") for line in text.splitlines())


async def capture_stack(pid: int, faulthandler: Optional[FaulthandlerDump], why_not_faulthandler: str = "",
                        subprocesses: bool = False) -> str:
    """The stack text, headed by the tool that read it, or "no stack: " and why each rung failed.
    faulthandler None: the process cannot be asked (why_not_faulthandler says why). subprocesses:
    py-spy reads the Python processes below pid too (a command may be a shell or a launcher)."""
    state = process_state(pid)
    spy = find_py_spy()
    notes = [f"process {pid} state: {describe_state(state)}"]
    # py-spy's suspending dump waits for the process to stop: one in uninterruptible I/O never
    # does (it would cost the whole timeout), one already stopped makes it fail at once
    if spy and can_run_handlers(state) and os.environ.get("TOKENPULSE_STACK_TOOL", "py-spy") != "faulthandler":
        out, why = await py_spy_dump(spy, pid, nonblocking=False, subprocesses=subprocesses)
        if out:
            return "py-spy dump:\n" + out
        notes.append(f"py-spy: {why}")
    if faulthandler is None:
        notes.append(f"faulthandler: not asked ({why_not_faulthandler})")
    elif not can_run_handlers(state):
        notes.append("faulthandler: not asked (a stopped or I/O-blocked process cannot run it)")
    else:
        dump = await faulthandler()
        if is_stack(dump):
            return "faulthandler dump:\n" + dump
        notes.append("faulthandler: the process wrote no stack (it could not run its handler)")
    if spy:
        out, why = await py_spy_dump(spy, pid, nonblocking=True, subprocesses=subprocesses)
        if out:
            return f"py-spy dump (--nonblocking; {'; '.join(notes)}):\n" + out
        notes.append(f"py-spy --nonblocking: {why}")
    else:
        notes.append("py-spy is not installed")
    return "no stack: " + "; ".join(notes)
