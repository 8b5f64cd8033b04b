"""Supervising a distributed job (torchrun and its ranks): per-rank events, a dying rank taking the
gang down at once, every rank's stacks on a stall, and the verdict naming the rank that failed.

torchrun tears its local group down when a rank fails, but a peer blocked in a collective may sit
there until the collective timeout, and torchrun itself waits for its workers: the agent does not
rely on it. A rank that vanishes without saying how it ended (kill -9, os._exit, a segfault) gets
torchrun DEATH_GRACE_S to exit on its own (its summary names the exit code), then every process of
the gang is SIGKILLed."""
from __future__ import annotations

import asyncio
import signal as signal_mod
import socket
from dataclasses import dataclass, field
from typing import Optional

from tokenpulse.diagnosis.stacks import find_py_spy, py_spy_dump
from tokenpulse.protocol import ExitVerdict
from worker.agent.ranks import RankBoard, diagnose, torchrun_failures

DEATH_GRACE_S = 2.0
DONE_STATES = ("completed", "paused", "cancelled", "queued")  # queued: checkpointed on a preemption


@dataclass
class GangState:
    board: RankBoard = field(default_factory=RankBoard)
    seen: dict[int, float] = field(default_factory=dict)  # rank pid -> first seen (agent clock)
    vanished: dict[int, float] = field(default_factory=dict)  # pid -> when it was first missing
    states: dict[int, tuple[float, dict]] = field(default_factory=dict)  # rank -> (t, its state event)
    died: Optional[str] = None  # "rank 1 (host, pid 12) ended without a word"
    died_rank: Optional[int] = None
    down_at: Optional[float] = None  # when a rank's end without finishing started the teardown
    killed: bool = False

    def observe(self, rank: int, kind: str, data: dict, t: float, now: float) -> None:
        self.board.observe(rank, kind, data, now)
        if kind == "state":
            self.states.setdefault(rank, (t, data))


def identify(g: GangState, pids: list[int], now: float) -> None:
    """A rank that has not said who it is (a command job's script) is known from /proc: its RANK
    from its environment, this host, its pid; so the rank table and the stacks name it too."""
    for pid in pids:
        if g.board.by_pid(pid) is not None:
            continue
        try:
            env = dict(x.split("=", 1) for x in open(f"/proc/{pid}/environ").read().split("\0") if "=" in x)
            rank = int(env["RANK"])
        except (OSError, KeyError, ValueError):
            continue
        rk = g.board.get(rank)
        if rk.pid is None or rk.pid != pid:
            rk.pid, rk.host = pid, rk.host or socket.gethostname()
            rk.alive_at = rk.alive_at or now


def watch_deaths(g: GangState, live_pids: list[int], now: float) -> Optional[str]:
    """Called every half second while torchrun runs. Returns a line once a rank has gone that did not
    finish (no completed/paused/cancelled state from it): the gang is then taken down (down_at)."""
    for pid in live_pids:
        g.seen.setdefault(pid, now)
        g.vanished.pop(pid, None)
    if g.down_at is not None:
        return None
    for pid in g.seen:
        if pid in live_pids:
            continue
        since = g.vanished.setdefault(pid, now)
        if now - since < 0.5:
            continue  # its last words may still be in the pipe
        rk = g.board.by_pid(pid)
        said = g.states.get(rk.rank) if rk is not None else None
        if said is not None and said[1].get("state") in DONE_STATES:
            continue
        name = f"rank {rk.rank} ({rk.host or '?'}, pid {pid})" if rk is not None else f"a rank (pid {pid})"
        g.down_at = now
        if said is None:  # no word from it: killed, or os._exit
            g.died, g.died_rank = name, rk.rank if rk is not None else None
            how = "ended without reporting (killed?)"
        else:
            how = f"failed ({said[1].get('failure') or 'error'})"
        return f"{name} {how}; stopping the whole gang (torchrun gets {DEATH_GRACE_S:.0f} s, then SIGKILL)"
    return None


def first_failure(g: GangState) -> Optional[tuple[int, dict]]:
    failed = [(t, r, d) for r, (t, d) in g.states.items() if d.get("state") == "failed"]
    if not failed:
        return None
    t, r, d = min(failed, key=lambda x: (x[0], x[1]))
    return r, d


def judge(g: GangState, verdict: ExitVerdict, tail: list[str]) -> ExitVerdict:
    """The agent's verdict on torchrun's exit, with the failing rank named: a rank that ended without
    a word first (killed, os._exit: its peers' errors are only the echo of it), else the earliest
    failed state. Exit codes come from torchrun's failure summary."""
    failures = torchrun_failures(tail)
    silent = [r for r in sorted(set(g.board.ranks) | set(failures)) if r not in g.states]
    rank = g.died_rank if g.died is not None else next((r for r in silent if r in failures), None)
    if rank is None and g.died is None and silent and verdict.state == "failed":
        rank = silent[0]
    if g.died is not None or rank is not None:
        rk = g.board.ranks.get(rank) if rank is not None else None
        name = g.died or f"rank {rank} ({rk.host if rk else '?'}, pid {rk.pid if rk else '?'})"
        code = sig = None
        how = "ended without reporting"
        if rank in failures:
            exit_code = failures[rank][0]
            if exit_code < 0:
                sig = signal_mod.Signals(-exit_code).name
                how = f"killed by {sig}"
            else:
                code = exit_code
                how = f"exited with code {code}"
        if rk is not None:
            rk.exit = how
        return ExitVerdict(state="failed", failure="signal" if sig else "crash", exit_code=code, signal=sig,
                           retry=True, reason=f"{name} {how}; the gang was stopped" + _others(g, rank))
    ff = first_failure(g)
    if ff is not None and verdict.state == "failed":
        r, d = ff
        rk = g.board.ranks.get(r)
        who = f"rank {r} ({rk.host if rk else '?'}, pid {rk.pid if rk else '?'})"
        failure = str(d.get("failure") or "crash")
        return verdict.model_copy(update={"failure": failure, "retry": failure in ("oom", "crash", "signal"),
                                          "reason": f"{who}: {d.get('reason') or 'failed'}"[:8000]})
    return verdict


def _others(g: GangState, dead: Optional[int]) -> str:
    said = [f"rank {r}: {d.get('reason', d.get('state'))}"[:300] for r, (_, d) in sorted(g.states.items()) if r != dead]
    return ("; then " + "; ".join(said)) if said else ""


async def rank_stacks(g: GangState, pids: list[int]) -> tuple[dict[int, str], str]:
    """Every rank's stacks (all threads; py-spy, --nonblocking when a rank cannot be suspended),
    keyed by rank, and one text with a header per rank for the alert."""
    spy = find_py_spy()
    stacks: dict[int, str] = {}
    parts = []
    if spy is None:
        return {}, "no stack: py-spy is not installed"
    results = await asyncio.gather(*(py_spy_dump(spy, pid, nonblocking=False) for pid in pids))
    for i, (pid, (out, why)) in enumerate(zip(pids, results)):
        if out is None:
            out, why2 = await py_spy_dump(spy, pid, nonblocking=True)
            why = why2 if out is None else why
        rk = g.board.by_pid(pid)
        rank = rk.rank if rk is not None else 1000 + i
        label = f"rank {rk.rank} ({rk.host}, pid {pid})" if rk is not None else f"pid {pid} (rank unknown)"
        if out:
            stacks[rank] = out
        parts.append(f"==== {label} ====\n{out or 'no stack: ' + why}")
    return stacks, "\n".join(parts)


async def stalled_message(g: GangState, pids: list[int]) -> tuple[str, str]:
    stacks, text = await rank_stacks(g, pids)
    return diagnose(stacks, g.board), text


def exits(g: GangState, tail: list[str]) -> dict[int, str]:
    """How each rank of this node ended, for the rank table's exit column: its code or signal from
    torchrun's failure summary, else the state it said, else 'stopped by gang' (taken down with it)."""
    failures = torchrun_failures(tail)
    out = {}
    for r in sorted(set(g.board.ranks) | set(failures)):
        rk = g.board.ranks.get(r)
        said = g.states.get(r, (0, {}))[1].get("state")
        if rk is not None and rk.exit:
            out[r] = rk.exit  # judge() named it (the rank that died)
        elif r in failures:
            code = failures[r][0]
            out[r] = f"killed by {signal_mod.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        elif said:
            out[r] = said
        else:
            out[r] = "stopped by gang"
    return out
