"""A stall alert's first line: a plain headline a person reads at a glance, e.g.
"Stuck 2 min in read_shard (train.py:41), rank 1; rank 0 waits in all_reduce". The learned-timeout
arithmetic and the user's own frames follow it on the next lines (the job page folds them under the
headline; the stack is attached apart). The user's frames are told from library frames by their path:
site-packages, the standard library and torch are libraries, anything else is the user's code."""
from __future__ import annotations

import os
import re
from typing import Optional

from worker.agent.ranks import _collective_in, _main_thread, odd_one

# Paths of code that is not the user's (web/static/job.js marks stack lines with the same rule)
LIBRARY = ("site-packages/", "dist-packages/", "/lib/python3", "/torch/", "<frozen ", "/usr/lib/python",
           "tokenpulse/instrument/")  # the startup hook's wrappers are not the user's code either
PYSPY = re.compile(r"^\s*(?P<func>\S.*?) \((?P<path>[^()]+):(?P<line>\d+)\)\s*$")
FAULTHANDLER = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>.+?)\s*$')


def is_library(path: str) -> bool:
    return any(x in path for x in LIBRARY)


def frames(stack: Optional[str]) -> list[tuple[str, str, int]]:
    """The main thread's frames, innermost first: (function, path, line), from a py-spy or a
    faulthandler dump."""
    out = []
    for line in _main_thread(stack or ""):
        m = PYSPY.match(line) or FAULTHANDLER.match(line)
        if m:
            out.append((m.group("func"), m.group("path"), int(m.group("line"))))
    return out


def short(frame: tuple[str, str, int]) -> str:
    func, path, line = frame
    return f"{func} ({os.path.basename(path)}:{line})"


def own_frames(stack: Optional[str]) -> list[tuple[str, str, int]]:
    return [f for f in frames(stack) if not is_library(f[1])]


def duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 90 * 60:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _where(stack: Optional[str]) -> Optional[str]:
    """The user's innermost frame (where their code is stuck), else the innermost frame at all; where
    the main thread waits for a DataLoader batch, the worker process's frame that holds it up."""
    worker = stuck_worker(stack)
    if worker is not None:
        pid, frame = worker
        return f"{short(frame)} in DataLoader worker {pid} (the training loop waits for its batch)"
    own, every = own_frames(stack), frames(stack)
    return short(own[0]) if own else short(every[0]) if every else None


def hang_frame(stack: Optional[str]) -> Optional[str]:
    """Where a hang is stuck, comparable between attempts (no pid in it): the user's innermost frame,
    a DataLoader worker's when the loop waits for its batch, else the innermost frame at all."""
    worker = stuck_worker(stack)
    if worker is not None:
        return f"{short(worker[1])} in a DataLoader worker"
    own, every = own_frames(stack), frames(stack)
    return short(own[0]) if own else short(every[0]) if every else None


def processes(stack: str) -> list[tuple[Optional[int], str]]:
    """A py-spy dump of a process tree (its --subprocesses sections), as (pid, that process's text)."""
    out = []
    for part in re.split(r"(?m)^(?=Process \d+:)", stack):
        m = re.match(r"Process (\d+):", part)
        if part.strip():
            out.append((int(m.group(1)) if m else None, part))
    return out


def stuck_worker(stack: Optional[str]) -> Optional[tuple[Optional[int], tuple[str, str, int]]]:
    """(pid, the user's innermost frame) of a DataLoader worker process, when the main thread waits in
    the DataLoader for a batch and a worker sits in the user's code (a collate or __getitem__ that
    never returns): that frame is where the job is stuck, not the loop's `for batch in loader`."""
    if not stack or not any("dataloader.py" in path for _, path, _ in frames(stack)):
        return None
    for pid, text in processes(stack)[1:]:
        if "_worker_loop (" in text or "in _worker_loop" in text:
            own = own_frames(text)
            if own:
                return pid, own[0]
    return None


def stall_headline(silent_s: float, stack: Optional[str], phase: str, step: Optional[int] = None) -> str:
    """A stall's headline, e.g. "Stuck 2 min at step 60 in read_shard (train.py:41)": the step the job
    last reported (the one its Step figure and phase line show) and where it is stuck; without a
    stack, the phase with its count."""
    at = _where(stack)
    return f"Stuck {duration(silent_s)}{at_step(step)} in {at}" if at else f"Stuck {duration(silent_s)} in {phase}"


def at_step(step: Optional[int]) -> str:
    return f" at step {step}" if step is not None else ""


def gang_headline(silent_s: float, stacks: dict[int, str], phase: str,
                  step: Optional[int] = None) -> tuple[str, Optional[str]]:
    """("Stuck 2 min in read_shard (train.py:41), rank 1; rank 0 waits in all_reduce", the stack of
    the rank named first)."""
    groups, odd = odd_one({r: s for r, s in stacks.items() if s})
    if not groups:
        return f"Stuck {duration(silent_s)} in {phase} (no rank's stack could be read)", None

    def who(rs: list[int]) -> str:
        return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))

    first = odd if odd is not None else next(iter(groups))
    rs = groups[first]
    whom = who(rs) if odd is not None else "every rank"
    where = _where(stacks[rs[0]])
    head = f"Stuck {duration(silent_s)}{at_step(step)} in {where}, {whom}" if where else \
        f"Stuck {duration(silent_s)} in {phase}, {whom}"
    others = []
    for w, rs in groups.items():
        if w == first:
            continue
        coll = _collective_in(stacks[rs[0]])
        verb = "waits" if len(rs) == 1 else "wait"
        others.append(f"{who(rs)} {verb} in {coll}" if coll else f"{who(rs)} {verb} in {_where(stacks[rs[0]]) or w}")
    return "; ".join([head] + others), stacks[groups[first][0]]


def folded(headline: str, details: str, stack: Optional[str]) -> str:
    """The alert's message: the headline, then the detail (timeout arithmetic, process state), then
    the user's own frames, innermost first."""
    own = own_frames(stack)
    lines = [headline, details]
    if own:
        lines.append("your code: " + " < ".join(short(f) for f in own[:6]))
    return "\n".join(lines)


# ---- a quiet job: where its main thread waits (advice.py's 'quiet' warning) ------------------------

LIBRARY_MARKS = ("site-packages", "dist-packages", "/lib/python", "<frozen")
WAIT_KINDS = (  # innermost frames that say what the main thread waits for
    (("socket.py", "ssl.py", "http/client.py", "urllib3", "requests"), "a socket (a network read)"),
    (("selectors.py", "select"), "select() on its sockets or pipes"),
    (("threading.py", "queue.py"), "a lock or a queue (another thread)"),
    (("multiprocessing/connection.py", "multiprocessing/queues.py"), "a worker process's pipe"),
    (("dataloader.py",), "the DataLoader's next batch"),
    (("datasets/iterable_dataset.py", "datasets/", "fsspec", "huggingface_hub"), "the dataset stream's fetch"),
)


def _frames(stack: str) -> list[str]:
    """The main thread's frames, innermost first, from a py-spy or faulthandler dump."""
    lines = stack.splitlines()
    out: list[str] = []
    on = False
    for line in lines:
        s = line.strip()
        if (line.startswith("Thread ") and ("MainThread" in line or not out)) or line.startswith("Current thread "):
            if out:
                break
            on = True
            continue
        if on:
            if not s or line.startswith(("Thread ", "Process ")):
                if out:
                    break
                continue
            if s.startswith("File "):  # faulthandler: File "path", line N in func
                try:
                    path, rest = s.split('"')[1], s.split('"', 2)[2]
                    s = f"{rest.split(' in ', 1)[1]} ({path}:{rest.split('line ')[1].split()[0]})"
                except IndexError:
                    pass
            out.append(s)
    return out


def waits_in(stack: Optional[str]) -> Optional[str]:
    """'the main thread waits in <frame>, <what it is>, called from <the script's own frame>'."""
    if not stack:
        return None
    frames = _frames(stack)
    if not frames:
        return None
    inner = frames[0]
    own = next((f for f in frames if not any(m in f for m in LIBRARY_MARKS)), None)
    what = next((label for marks, label in WAIT_KINDS if any(m in inner for m in marks)), None)
    if what is None and own is not None and own != inner:
        what = next((label for marks, label in WAIT_KINDS if any(m in f for f in frames[:frames.index(own)]
                                                                 for m in marks)), None)
    msg = f"the main thread waits in {inner}"
    if what:
        msg += f": {what}"
    if own and own != inner:
        msg += f", called from the script's {own}"
    elif own:
        msg += " (the script's own code)"
    return msg + ": it is working or waiting on its input, not hung"
