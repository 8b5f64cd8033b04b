"""Reading a training process's stacks from outside it.

py-spy's default dump suspends the process with ptrace first; a process that is already stopped
(SIGSTOP, a debugger) cannot be suspended again and the dump fails. `--nonblocking` reads the
process's memory without stopping it, so it works on a stopped, deadlocked or I/O-stuck process,
which is exactly when the process's own faulthandler cannot run. Both need ptrace permission on the
target (root, or the same user where Yama allows it: the training process names its agent as an
allowed tracer, see worker/agent/child.py)."""
from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path
from typing import Optional

STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O (disk sleep)", "T": "stopped (SIGSTOP?)",
          "t": "stopped by a tracer", "Z": "a zombie", "X": "dead", "I": "idle"}


def find_py_spy() -> Optional[str]:
    """py-spy installs beside the interpreter; a venv's bin is often not on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def process_state(pid: int) -> Optional[str]:
    """The kernel's one-letter state of a process (R, S, D, T...), or None where /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def describe_state(state: Optional[str]) -> str:
    return f"{state} ({STATES.get(state, 'unknown')})" if state else "unknown"


def can_run_handlers(state: Optional[str]) -> bool:
    """A stopped process or one in uninterruptible I/O will not run a signal handler now."""
    return state not in ("T", "t", "D", "Z", "X")


async def py_spy_dump(spy: str, pid: int, nonblocking: bool, timeout: float = 20,
                      subprocesses: bool = False) -> tuple[Optional[str], str]:
    """(the dump, or None; py-spy's error text). subprocesses: also the Python processes below pid."""
    args = [spy, "dump", "--full-filenames", "--pid", str(pid)] + (["--nonblocking"] if nonblocking else [])
    args += ["--subprocesses"] if subprocesses else []
    try:
        p = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE)
    except OSError as e:
        return None, str(e)
    try:
        out, err = await asyncio.wait_for(p.communicate(), timeout)
    except asyncio.TimeoutError:
        p.kill()
        await p.wait()
        return None, f"py-spy took over {timeout:.0f} s"
    text = out.decode(errors="replace")
    if p.returncode == 0 and "Thread " in text:
        return text, ""
    # the first line of py-spy's error says what failed (permission, "Failed to suspend process"...)
    why = (err.decode(errors="replace").strip() or text.strip()).splitlines()
    return None, " / ".join(why[:3])[:300]
