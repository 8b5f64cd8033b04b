"""How an attempt ended, judged once its process is gone: the job's own state event, the exit code or
signal, what was asked of it, a gang's ranks and the last output, made into one ExitVerdict (the
authoritative `state` event); and the job's open alerts closed, saying how it ended."""
from __future__ import annotations

import time

from pydantic import ValidationError

from tokenpulse.protocol import AlertKind, ExitVerdict, Failure
from worker.agent import gangwatch
from worker.agent.child import describe_exit
from worker.agent.output import last_traceback_frame
from worker.agent.running import Requested, RunningJob


def final_verdict(rj: RunningJob, returncode: int, agent_name: str) -> ExitVerdict:
    """The exit judged, a gang's failing rank named and each rank's end, and for a crash where the
    job had got to."""
    verdict = judge_exit(rj, returncode, agent_name)
    if rj.gang is not None and rj.requested is None:
        verdict = gangwatch.judge(rj.gang, verdict, list(rj.process.tail))
    if rj.gang is not None:
        verdict.ranks = gangwatch.exits(rj.gang, list(rj.process.tail))
    if verdict.state == "failed" and verdict.failure in (Failure.CRASH, Failure.SIGNAL):
        d = rj.detector
        ago = time.time() - d.last_progress if d.last_progress else 0
        verdict.reason = (f"{verdict.reason or ''}\nlast progress: {d.where()}, "
                          f"{ago:.0f} s before the exit")[-8000:]
    return verdict


def judge_exit(rj: RunningJob, returncode: int, agent_name: str) -> ExitVerdict:
    code, sig, words = describe_exit(returncode)
    child = rj.child_state or {}
    said = child.get("state")
    what = "command" if rj.command is not None else "training process"
    if rj.requested == Requested.SHUTDOWN and said == "paused":  # checkpointed on the way out: requeue,
        return ExitVerdict(state="queued", exit_code=code,  # no retry spent
                           reason=f"agent {agent_name} shut down; requeued ({child.get('reason', 'checkpoint saved')})")
    if rj.requested == Requested.SHUTDOWN and said is None:
        return ExitVerdict(state="failed", failure=Failure.LOST, exit_code=code, signal=sig, retry=True,
                           reason=f"agent {agent_name} shut down; {what} {words}")
    if returncode == 0 and said in ("completed", "paused", "cancelled"):
        try:  # the job's own word, as it said it
            return ExitVerdict.model_validate({**child, "exit_code": 0})
        except ValidationError:  # a command's own state event with odd fields: its state stands
            return ExitVerdict(state=said, exit_code=0)
    if rj.requested == Requested.CANCEL:
        return ExitVerdict(state="cancelled", reason=f"cancelled by user; {what} {words}", exit_code=code, signal=sig)
    tail = "\n".join(list(rj.process.tail)[-15:])
    if rj.command is not None and not child.get("failure"):
        # A command is judged by its exit: 0 is success; another code is a failure of the script
        # (not retried: it would fail the same way), named by its traceback's innermost frame; a
        # signal (killed, crashed) goes to the retry policy below.
        if returncode == 0:
            return ExitVerdict(state="completed", exit_code=0)
        if sig is None:
            frame = last_traceback_frame(list(rj.stderr_tail), str(rj.cwd) if rj.cwd else None)
            reason = f"{frame}\n" if frame else ""
            reason += f"command {words}" + (f"; last output:\n{tail}" if tail else "")
            return ExitVerdict(state="failed", reason=reason[:8000], failure=Failure.ERROR, exit_code=code, retry=False)
    failure = str(child.get("failure") or (Failure.SIGNAL if sig else Failure.CRASH))
    reason = str(child.get("reason") or f"{what} {words}")
    if tail and not child.get("reason"):
        reason += f"; last output:\n{tail}"
    return ExitVerdict(state="failed", reason=reason, failure=failure, exit_code=code, signal=sig,
                       retry=failure in (Failure.OOM, Failure.CRASH, Failure.SIGNAL))


def close_alerts(rj: RunningJob, verdict: ExitVerdict, emit, disk_alert_open: bool) -> None:
    """The process is gone: open stalled/slow alerts close (saying how it ended); a crash alerts."""
    how = f"the {'command' if rj.command is not None else 'training process'} ended ({verdict.state})"
    if disk_alert_open:
        emit(rj, "alert", {"kind": AlertKind.DISK_FULL, "message": how, "clear": True})
    if rj.detector.stalled or rj.stall_clear is not None:
        emit(rj, "alert", {"kind": AlertKind.STALLED, "message": how, "clear": True})
    if rj.gang is not None and rj.gang.board.straggler is not None:
        emit(rj, "alert", {"kind": AlertKind.STRAGGLER, "message": how, "clear": True})
    if rj.slow is not None and rj.slow.open_keys:
        emit(rj, "alert", {"kind": AlertKind.SLOW, "message": how, "clear": True})
    if rj.advice is not None:
        for kind in list(rj.advice.open) + ([AlertKind.QUIET] if rj.advice.quiet_open else []):
            emit(rj, "alert", {"kind": kind, "message": how, "clear": True})
    if rj.slow is not None and rj.slow.contention_open:
        emit(rj, "alert", {"kind": AlertKind.CONTENTION, "message": how, "clear": True})
    if verdict.state == "failed" and verdict.failure in (Failure.CRASH, Failure.SIGNAL, Failure.ERROR):
        # the root cause alone: the traceback and the last output are shown once, in the job's
        # reason (and its log), not a second time in the alert
        head, _, rest = (verdict.reason or "training process crashed").partition("\n")
        head = head.split("; last output:")[0]
        has_more = bool(rest) or "; last output:" in (verdict.reason or "")
        more = " (traceback and last output in the job's reason)" if has_more else ""
        emit(rj, "alert", {"kind": AlertKind.CRASHED, "severity": "critical", "message": (head + more)[:8000]})
