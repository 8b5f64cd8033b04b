"""The ranks of a distributed job, as the agent sees them: who they are (host, pid, device), how far
each got (step, step time, last progress, memory), which one straggles, which one is stuck (stacks of
every rank grouped by where they are), and which one died. Pure logic, clock passed in."""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from tokenpulse.diagnosis.stall import stuck_at
from tokenpulse.protocol import AlertKind
from worker.agent.anatomy import straggler_cause
from worker.agent.hysteresis import CLEAR, OPEN, Latch

# A frame in one of these is waiting for the other ranks, not working: collectives, the DDP reducer
# inside backward, rendezvous and barriers.
WAITING = ("torch/distributed/", "_engine_run_backward", "torch/autograd/", "all_reduce", "barrier",
           "broadcast", "all_gather", "reduce_scatter", "distributed.py")


@dataclass
class Rank:
    rank: int
    host: Optional[str] = None
    pid: Optional[int] = None
    device: Optional[str] = None
    step: Optional[int] = None
    step_time_s: Optional[float] = None
    busy_s: Optional[float] = None
    rss_mb: Optional[float] = None
    data_s: Optional[float] = None  # its step anatomy (a command job's startup hook): waiting for data,
    compute_s: Optional[float] = None  # forward+backward+optimizer,
    comm_s: Optional[float] = None  # and blocked in collectives, seconds per step
    alive_at: Optional[float] = None
    progress_at: Optional[float] = None
    exit: Optional[str] = None  # how it ended, when it did
    stack: Optional[str] = None  # its stacks, asked for by node rank 0's agent; sent once

    def row(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


BUSY_WINDOWS = 4  # a rank's last step-anatomy windows (3 s each) judged for the straggler rule


@dataclass
class RankBoard:
    ranks: dict[int, Rank] = field(default_factory=dict)
    straggler: Optional[int] = None  # the rank named by the open straggler alert
    # Hysteresis of the straggler condition (StallConfig.alert_open_s / alert_clear_s, given at creation)
    open_s: float = 0.0
    clear_s: float = 0.0
    latch: Optional[Latch] = None
    busy_recent: dict = field(default_factory=dict)  # rank -> its last few busy_s reports

    def get(self, r: int) -> Rank:
        return self.ranks.setdefault(r, Rank(rank=r))

    def observe(self, r: int, kind: str, data: dict, now: float) -> None:
        rk = self.get(r)
        rk.alive_at = now
        if kind == "info" and "rank" in data:
            rk.host, rk.pid, rk.device = data.get("host"), data.get("pid"), data.get("device")
        if kind == "alive":
            step = data.get("step")
            if step is not None and step != rk.step:
                rk.step, rk.progress_at = int(step), now
            for k in ("step_time_s", "busy_s", "rss_mb", "data_s", "compute_s", "comm_s"):
                if isinstance(data.get(k), (int, float)):
                    setattr(rk, k, float(data[k]))
            # the straggler rule's figure: the window's median step (busy_step_s, a command job's hook),
            # else its mean (tokenpulse's own loop reports busy_s alone)
            busy = data.get("busy_step_s", data.get("busy_s"))
            if isinstance(busy, (int, float)):
                recent = self.busy_recent.setdefault(r, deque(maxlen=BUSY_WINDOWS))
                if not recent or recent[-1] != float(busy):  # every alive repeats the last window's
                    recent.append(float(busy))

    def rows(self) -> list[dict]:
        return [self.ranks[r].row() for r in sorted(self.ranks)]

    def by_pid(self, pid: int) -> Optional[Rank]:
        return next((rk for rk in self.ranks.values() if rk.pid == pid), None)

    def check_straggler(self, factor: float = 3.0, floor_s: float = 0.05,
                        now: float = 0.0) -> Optional[tuple[str, Optional[str]]]:
        """('straggler' | 'straggler_clear', message) when one rank's own work per step (waits for the
        others left out) is far above the median of the others, held for open_s; cleared only when the
        ranks agree again (under 2/3 of the factor) for clear_s. The alert is the condition, not the
        rank: when the rank blamed changes while it lasts, the open alert is updated to name the new
        one, never cleared and re-opened.

        A rank's own work is the least of its last BUSY_WINDOWS reports: an evaluation, a checkpoint
        save or a descheduled step inflates a window for one rank or all, and a DDP gradient
        all-reduce waited on inside backward counts as work (no Python call to time); the quietest
        window is the rank's real pace, so only a rank slow in every recent window is a straggler."""
        busy = {r: min(self.busy_recent.get(r) or [rk.busy_s])
                for r, rk in self.ranks.items() if rk.busy_s is not None}
        if len(busy) < 2:
            return None
        worst = max(busy, key=lambda r: busy[r])
        others = sorted(v for r, v in busy.items() if r != worst)
        med = others[len(others) // 2]
        if self.latch is None:
            self.latch = Latch(self.open_s, self.clear_s)
        need = factor if not self.latch.is_open else factor * 2 / 3
        change = self.latch.update(busy[worst] > max(need * med, floor_s), now)
        rk = self.ranks[worst]
        message = (f"straggler: rank {worst} ({rk.host or '?'}, pid {rk.pid or '?'}) works "
                   f"{busy[worst]:.2f} s per step against {med:.2f} s for the other ranks "
                   f"({busy[worst] / max(med, 1e-9):.0f}x): every step waits for it{self.cause(worst)}")
        if change == OPEN or (self.latch.is_open and change is None and worst != self.straggler
                              and busy[worst] > max(need * med, floor_s)):
            self.straggler = worst
            return AlertKind.STRAGGLER, message
        if change == CLEAR:
            r, self.straggler = self.straggler, None
            return f"{AlertKind.STRAGGLER}_clear", f"the ranks keep pace with each other again (rank {r} was slowest)"
        return None


    def cause(self, worst: int) -> str:
        """Why the straggler is slow, from every rank's step anatomy (a command job's startup hook):
        '; it is 2.4x slower in forward+backward (...); the others wait 0.25 s per step in all_reduce',
        or '' when the ranks did not report it."""
        parts = {r: {"data_s": rk.data_s, "compute_s": rk.compute_s, "comm_s": rk.comm_s}
                 for r, rk in self.ranks.items() if rk.data_s is not None and rk.compute_s is not None}
        return straggler_cause(parts, worst) if worst in parts else ""


def _is_waiting(where: str, stack: str) -> bool:
    return any(w in where for w in WAITING) or _collective_in(stack) is not None


def _collective_in(stack: str) -> Optional[str]:
    """The collective a rank's main thread sits in, if any (innermost named one)."""
    main = _main_thread(stack)
    for line in main:
        for name in ("all_reduce", "broadcast_object_list", "broadcast", "barrier", "all_gather",
                     "reduce_scatter", "_engine_run_backward"):
            if line.strip().startswith(name + " ") or f" in {name}" in line:
                return "all_reduce (DDP gradients, in backward)" if name == "_engine_run_backward" else name
    return None


def _main_thread(stack: str) -> list[str]:
    lines = stack.splitlines()
    for i, line in enumerate(lines):
        if ('"MainThread"' in line and line.startswith("Thread ")) or line.startswith("Current thread "):
            out = []
            for x in lines[i + 1:]:
                if not x.strip() or x.startswith("Thread "):
                    break
                out.append(x)
            return out
    return []


def _our_frames(stack: str, n: int = 2) -> Optional[str]:
    """The innermost frames in the job's own code (not torch's or the interpreter's): where the rank
    called the collective from, e.g. "agree (distributed.py:111) < run (loop.py:150)"."""
    own = [x.strip() for x in _main_thread(stack)
           if "site-packages" not in x and "/torch/" not in x and "/lib/python3" not in x and x.strip()
           and "tokenpulse/instrument/" not in x]  # the startup hook's timing wrapper is not the job's
    return " < ".join(own[:n]) or None


def odd_one(stacks: dict[int, str]) -> tuple[dict[str, list[int]], Optional[str]]:
    """Ranks grouped by their main thread's innermost frame, and the odd group's frame: the group not
    waiting in a collective (the others wait for it); failing that, the smallest group (None: one group)."""
    groups: dict[str, list[int]] = {}
    for r in sorted(stacks):
        where = stuck_at(stacks[r]) or "no stack"
        groups.setdefault(where, []).append(r)
    working = [w for w in groups if w != "no stack" and not _is_waiting(w, stacks[groups[w][0]])]
    if len(working) == 1 and len(groups) > 1:
        return groups, working[0]
    if len(groups) > 1:
        return groups, min(groups, key=lambda w: (len(groups[w]), w in working))
    return groups, None


def diagnose(stacks: dict[int, str], board: RankBoard) -> str:
    """"rank 1 (host, pid 12) at fn (file:line); ranks 0 waiting in all_reduce at fn (file:line)".

    Ranks are grouped by their main thread's innermost frame. The odd one out is the group that is
    not waiting in a collective (the others wait for it); failing that, the smallest group."""
    groups, odd = odd_one(stacks)
    if not groups:
        return "no rank's stack could be read"

    def who(rs: list[int]) -> str:
        if len(rs) == 1:
            rk = board.ranks.get(rs[0]) or Rank(rank=rs[0])
            return f"rank {rs[0]} ({rk.host or '?'}, pid {rk.pid or '?'})"
        return "ranks " + ", ".join(map(str, rs))

    parts = []
    if odd is not None:
        parts.append(f"{who(groups[odd])} at {odd}")
    for w, rs in groups.items():
        if w == odd:
            continue
        coll = _collective_in(stacks[rs[0]])
        if coll:
            parts.append(f"{who(rs)} waiting in {coll} at {_our_frames(stacks[rs[0]]) or w}")
        else:
            parts.append(f"{who(rs)} at {w}")
    if odd is None:
        parts[0] = "every rank at the same place: " + parts[0]
    return "; ".join(parts)


FAILURE_RE = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)", re.S)


def torchrun_failures(tail: list[str]) -> dict[int, tuple[int, int]]:
    """rank -> (exit code, pid) for every failed rank in torchrun's failure summary, if it printed one."""
    text = "\n".join(tail)
    at = text.find("Failures:")
    at = at if at >= 0 else max(text.find("Root Cause"), 0)
    return {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in FAILURE_RE.finditer(text, at)}
