"""A running job judged while it runs: stalled (with the stack that says where), slow, quiet, a
command's first-steps advice, a gang's dying rank or straggler. The rules live in the detectors
(tokenpulse/diagnosis/stall.py, slow.py, advice.py, ranks.py); this room feeds them what the agent
reads of the process and turns their verdicts into alerts.

It is handed what it needs from the other rooms: `emit` (a job's events out), `call` (a server
call, for the stacks of a multi-node job's other nodes) and `agent_id`."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Awaitable, Callable, Optional

import httpx

from tokenpulse.diagnosis.capture import capture_stack
from tokenpulse.diagnosis.stacks import can_run_handlers, describe_state, process_state
from tokenpulse.diagnosis.stall import ALIVE_CLAUSE, stuck_at
from tokenpulse.protocol import AlertKind
from worker.agent import fixes, gangstacks, gangwatch
from worker.agent.advice import Advisor
from worker.agent.headline import folded, gang_headline, hang_frame, stall_headline
from worker.agent.ranks import diagnose
from worker.agent.running import Emitter, Requested, RunningJob
from worker.agent.sysmetrics import read_schedstat

log = logging.getLogger("tokenpulse.agent")

STOPPED_LOOK_S = 5.0  # silent this long (its alive thread speaks each second): is the process stopped?

Call = Callable[..., Awaitable[Optional[httpx.Response]]]


class JobDiagnosis:
    def __init__(self, emit: Emitter, call: Call, agent_id: Callable[[], Optional[int]]):
        self.emit, self.call, self.agent_id = emit, call, agent_id

    # ---- stacks ----------------------------------------------------------------------------------

    async def capture_stack(self, rj: RunningJob) -> str:
        """Every thread's Python stack, on the one ladder (tokenpulse/diagnosis/capture.py). Its
        faulthandler answers on its stderr, which read_output collects; before its first event its
        SIGUSR1 handler may not exist yet (a command job has it once its instrumentation speaks: an
        uninstrumented one never)."""
        why_not = ("the command reports no events (not instrumented)" if rj.command is not None
                   else "the process has not started reporting yet")
        dump = (lambda: self.faulthandler_dump(rj)) if rj.detector.events else None
        stack = await capture_stack(rj.process.pid, dump, why_not,
                                    subprocesses=rj.command is not None)  # a command may be a shell or launcher
        if stack.startswith("no stack: "):
            log.info("job %s: %s", rj.claim.job_id, stack)
        return stack

    async def faulthandler_dump(self, rj: RunningJob) -> str:
        """faulthandler writes every thread's stack to stderr; read_output collects the lines."""
        rj.stack_lines = []
        rj.process.signal(signal.SIGUSR1)
        end, seen, quiet_since = time.monotonic() + 3.0, 0, time.monotonic()
        while time.monotonic() < end:
            await asyncio.sleep(0.1)
            if len(rj.stack_lines) != seen:
                seen, quiet_since = len(rj.stack_lines), time.monotonic()
            elif seen and time.monotonic() - quiet_since > 0.3 and any(
                    x.startswith(("Current thread", "Thread 0x")) for x in rj.stack_lines):
                break  # the dump is complete: lines stopped arriving
        lines, rj.stack_lines = rj.stack_lines, None
        return "\n".join(lines)

    # ---- while it runs -----------------------------------------------------------------------------

    def watch_gang(self, rj: RunningJob, g: gangwatch.GangState) -> None:
        """A rank that ended without finishing takes the whole gang down within seconds (g: rj.gang)."""
        now = time.time()
        pids = rj.process.ranks()
        gangwatch.identify(g, pids, now)  # ranks that have not said who they are (a command's)
        line = gangwatch.watch_deaths(g, pids, now)
        if line is not None:
            self.emit(rj, "log", {"line": f"agent: {line}", "stream": "agent"})
        if g.down_at is not None and not g.killed and now - g.down_at >= gangwatch.DEATH_GRACE_S:
            g.killed = True
            rj.process.kill_all()
        v = g.board.check_straggler(now=now)
        if v is not None:
            kind, message = v
            self.emit(rj, "alert", {"kind": AlertKind.STRAGGLER, "severity": "warning", "message": message,
                                    "clear": kind.endswith("_clear")})

    async def detect(self, rj: RunningJob, now: float) -> None:
        # A command that reports nothing (not instrumented, not Python) is judged by its output lines.
        if rj.gang is None and now - (rj.detector.last_event or now) > STOPPED_LOOK_S:
            # silent, even its alive thread: a stopped process is stalled at the floor (one /proc read)
            rj.detector.observe_stopped(process_state(rj.process.pid) in ("T", "t"), now)
        elif rj.detector.stopped_since is not None:
            rj.detector.observe_stopped(False, now)  # it spoke: continued
        v = rj.detector.check(now)
        if v is not None:
            rj.stall_clear = None  # stalled again before its clear was due: the open alert goes on
        elif rj.stall_clear is not None and now - rj.stall_clear[0] >= rj.detector.config.alert_clear_s:
            self.emit(rj, "alert", {"kind": AlertKind.STALLED, "message": rj.stall_clear[1], "clear": True})
            rj.stall_clear = None
        if v is not None and v.kind == AlertKind.STALLED and rj.gang is not None and rj.claim.node_rank:
            pass  # another node's share: node rank 0's agent judges the gang, asking for these stacks
        elif v is not None and v.kind == AlertKind.STALLED and rj.gang is not None:
            where, stack, stacks = await self.gang_verdict(rj, rj.gang)
            if rj.process.started.returncode is None:
                self.say_step(rj)
                head, odd_stack = gang_headline(v.silent_s, stacks, rj.detector.where(), rj.detector.step)
                self.note_hang(rj, now, head, hang_frame(odd_stack))
                message = folded(head, f"{v.message}; {where}", odd_stack)
                self.emit(rj, "alert", {"kind": AlertKind.STALLED, "severity": "critical",
                                        "message": message[:8192], "stack": stack[-199_000:],
                                        "data": {"stuck_since": time.time() - v.silent_s}})
        elif v is not None and v.kind == AlertKind.STALLED:
            stack = await self.capture_stack(rj)
            if rj.process.started.returncode is not None:
                return  # it ended while we looked: the exit tells the story
            stuck = stuck_at(stack)
            state = process_state(rj.process.pid)
            message = v.message
            if not can_run_handlers(state):  # its alive thread spoke a moment ago, but it is frozen now
                message = message.replace(ALIVE_CLAUSE, "") + f"; process state {describe_state(state)}"
            message += f"; stuck at {stuck}" if stuck else ""
            self.say_step(rj)
            head = stall_headline(v.silent_s, stack, rj.detector.where(), rj.detector.step)
            self.note_hang(rj, now, head, hang_frame(stack))
            message = folded(head, message, stack)
            # since when: the page keeps the headline's "Stuck 30 s" current while the alert is open
            self.emit(rj, "alert", {"kind": AlertKind.STALLED, "severity": "critical", "message": message,
                                    "stack": stack[-199_000:] if stack else None,
                                    "data": {"stuck_since": time.time() - v.silent_s}})
        self.end_hang(rj, now)
        if rj.advice is not None:
            await self.advise(rj, rj.advice, now)
        if rj.slow is None:
            return
        sched = read_schedstat(rj.process.pid)  # CPU time vs waiting for a CPU: tells a busy machine
        if sched is not None:
            rj.slow.machine.observe_sched(now, *sched)
        rj.slow.machine.observe_load(os.getloadavg()[0], os.cpu_count())
        for v in (rj.slow.check(now), rj.slow.check_contention(now)):
            if v is None:
                continue
            kind, clear = v.kind.removesuffix("_clear"), v.kind.endswith("_clear")
            severity = "info" if kind == AlertKind.CONTENTION else "warning"
            alert = {"kind": kind, "severity": severity, "message": v.message, "clear": clear}
            if kind == AlertKind.SLOW and not clear:  # its fixes as changes, its causes priced in time
                spec = rj.claim.spec.model_dump(mode="json") if rj.command is None else None
                data = fixes.for_slow(v.reasons, rj.slow, spec)
                alert["data"] = data
                if data["costs"]:
                    alert["message"] = (v.message + "; " + "; ".join(c["text"] for c in data["costs"]))[:8192]
            self.emit(rj, "alert", alert)

    def say_step(self, rj: RunningJob) -> None:
        """A stall opens: the phase with the step the job last reported (on `alive`, ahead of its
        rate-limited phase line and its metrics), timed when it was reached, so that the job's Step,
        its phase line and the alert name one step."""
        line = rj.detector.phase_line()
        if line is not None:
            self.emit(rj, "phase", line, rj.detector.last_progress)

    # ---- a stall that lasts: a hang --------------------------------------------------------------

    @staticmethod
    def note_hang(rj: RunningJob, now: float, headline: str, frame: Optional[str]) -> None:
        """A stall alerted: where it is stuck, kept for the hang's verdict (the first alert's time)."""
        since = rj.hang["since"] if rj.hang is not None else now
        rj.hang = {"since": since, "step": rj.detector.step, "frame": frame, "headline": headline}

    def end_hang(self, rj: RunningJob, now: float) -> None:
        """Moving again: no hang. Stalled for stall.kill_after_s since its alert: the attempt is ended
        (SIGKILL of its tree: a hung step cannot checkpoint) and judged a hang (exits.py), which the
        retry policy retries once from the newest checkpoint, and not again if it hangs at the same
        step in the same frame."""
        if not rj.detector.stalled:
            rj.hang = None
            return
        if rj.hang is None or rj.kill_after_s <= 0 or rj.requested is not None \
                or now - rj.hang["since"] < rj.kill_after_s:
            return
        rj.requested = Requested.HANG
        at = f" at step {rj.hang['step']}" if rj.hang.get("step") is not None else ""
        self.emit(rj, "log", {"line": f"agent: stalled{at} {now - rj.hang['since']:.0f} s since its alert "
                                      f"(stall.kill_after_s={rj.kill_after_s:g}); killing it to end the attempt "
                                      "as a hang", "stream": "agent"})
        rj.process.kill_all()

    async def advise(self, rj: RunningJob, advice: Advisor, now: float) -> None:
        """A command job's verdicts on its first steps (worker/agent/advice.py; advice: rj.advice), and
        the 'quiet' warning: a finished phase and nothing since, with where the main thread waits."""
        for kind, message in advice.check(now):
            alert: dict = {"kind": kind, "severity": "warning", "message": message[:8192]}
            fix = fixes.for_advice(kind, advice, list(rj.command.command)) if rj.command is not None else None
            if fix is not None:  # the Trainer argument as a change of the command line
                alert["data"] = {"fixes": [fix]}
            self.emit(rj, "alert", alert)
        head = advice.quiet.due(rj.detector, now)
        if head is not None:
            stack = await self.capture_stack(rj)
            if rj.process.started.returncode is None and rj.detector.last_progress is not None \
                    and now - rj.detector.last_progress >= 0 and not rj.detector.stalled:
                self.emit(rj, "alert", {"kind": AlertKind.QUIET, "severity": "warning",
                                        "message": advice.quiet.message(head, stack)[:8192],
                                        "stack": stack[-199_000:] if stack else None})
        line = advice.quiet.phase_line(now)
        if line is not None:  # a finished phase is never the job's status: the phase line says it is quiet
            self.emit(rj, "phase", line)

    # ---- a gang's stacks ----------------------------------------------------------------------------

    async def gang_verdict(self, rj: RunningJob, gang: gangwatch.GangState) -> tuple[str, str, dict]:
        """The stuck rank named across the gang (rj.gang): this node's stacks, and on a multi-node
        job every other node's, as their agents sent them (worker/agent/gangstacks.py). (verdict,
        every rank's stacks as one text, rank -> its stack)."""
        stacks, text = await gangwatch.rank_stacks(gang, rj.process.ranks())
        spec = rj.claim.spec
        if spec.nnodes <= 1:
            return diagnose(stacks, gang.board), text, stacks

        path = f"/api/agents/{self.agent_id()}/jobs/{rj.claim.job_id}/stacks"
        await self.call("POST", path)  # the other nodes' agents read theirs on their next heartbeat

        async def fetch():
            r = await self.call("GET", path)
            return r.json() if r is not None and r.status_code == 200 else None
        remote = await gangstacks.gather(fetch, stacks, spec.nnodes * spec.nproc_per_node)
        stacks, text, board = gangstacks.merged(gang, stacks, text, remote)
        return diagnose(stacks, board), text, stacks

    async def log_gang_stacks(self, rj: RunningJob, gang: gangwatch.GangState) -> None:
        """A person's stack request on a multi-node job: the merged verdict and every node's stacks."""
        where, stack, _ = await self.gang_verdict(rj, gang)
        self.emit(rj, "log", {"line": f"{where}\n{stack}"[:8000], "stream": "agent"})
