"""What the server asks of the jobs this agent runs (the commands in its answers): a cancel, a pause,
a stack; each applied to the attempt it is about."""
from __future__ import annotations

import asyncio
import signal
import time

from tokenpulse.protocol import Action, Command
from worker.agent import gangstacks, gangwatch
from worker.agent.job_diagnosis import JobDiagnosis
from worker.agent.running import Emitter, Requested, RunningJob


class JobCommands:
    def __init__(self, jobs: dict[int, RunningJob], emit: Emitter, diagnosis: JobDiagnosis, grace_s: float):
        self.jobs, self.emit, self.diagnosis, self.grace_s = jobs, emit, diagnosis, grace_s

    async def handle(self, commands: list[Command], sent: float = float("inf")) -> None:
        """Commands in the server's answer to a message this agent sent at `sent` (monotonic)."""
        for c in commands:
            rj = self.jobs.get(c.job_id)
            if rj is None:
                continue
            if c.action in (Action.CANCEL, Action.PAUSE) and sent < rj.started:
                # about an earlier attempt of this job (taken from this agent after a lost lease and
                # given back to it): never this one. A cancel or pause asked of this attempt is in
                # the answer to every message, so the next one brings it.
                continue
            action = c.action
            if action == Action.STACK and rj.claim.node_rank and rj.gang is not None:
                # node rank 0's agent asked: sent with the next heartbeat
                gangstacks.share(rj.gang, (await gangwatch.rank_stacks(rj.gang, rj.process.ranks()))[0])
            elif action == Action.STACK and rj.gang is not None and rj.claim.spec.nnodes > 1:
                # waits on the other nodes: not in the heartbeat
                asyncio.create_task(self.diagnosis.log_gang_stacks(rj, rj.gang))
            elif action == Action.STACK:
                stack = (await gangwatch.stalled_message(rj.gang, rj.process.ranks()))[1] if rj.gang \
                    else await self.diagnosis.capture_stack(rj)
                self.emit(rj, "log", {"line": stack[:8000], "stream": "agent"})
            elif action == Action.PAUSE and rj.command is not None and not rj.pausable and rj.requested is None:
                # The server refuses such a pause (409); a job whose process has not said pausable in this
                # attempt is never sent SIGUSR2 (its default action kills).
                rj.requested = Requested.PAUSE_REFUSED
                refused = ("agent: pause requested, but this command has not said it can pause "
                           "(no Trainer instrumentation); it keeps running")
                self.emit(rj, "log", {"line": refused, "stream": "agent"})
            elif action in (Action.CANCEL, Action.PAUSE) and (rj.requested is None or (action, rj.requested) in (
                    (Action.CANCEL, Requested.PAUSE), (Action.CANCEL, Requested.PAUSE_REFUSED))):
                rj.requested = Requested(action)
                self.emit(rj, "log", {"line": f"agent: {action} requested", "stream": "agent"})
                if action == Action.CANCEL:
                    asyncio.create_task(rj.process.stop(signal.SIGTERM, self.grace_s))
                else:  # pause: the training process checkpoints and exits; give it time to save
                    asyncio.create_task(self.pause(rj))

    async def pause(self, rj: RunningJob) -> None:
        """SIGUSR2 asks the training process to checkpoint and exit paused. A process a moment old may
        not have its handler yet (SIGUSR2's default action kills), so wait for its first event (its
        handlers are installed right after its event pipe opens), however loaded the machine is."""
        while rj.claim.job_id in self.jobs and (rj.process.proc is None or (
                rj.alive_at <= rj.born and time.monotonic() - rj.started < 120 and rj.process.proc.returncode is None)):
            await asyncio.sleep(0.2)
        if rj.process.proc is not None and rj.requested == Requested.PAUSE:
            rj.asked_at = time.time()
            await rj.process.stop(signal.SIGUSR2, max(self.grace_s, 120))
