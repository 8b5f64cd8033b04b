"""How an attempt ended, judged once its process is gone: the job's own state event, the exit code or
signal, what was asked of it, a gang's ranks and the last output, made into one ExitVerdict (the
authoritative `state` event); and the job's open alerts closed, saying how it ended."""
from __future__ import annotations

import re
import time
from typing import Optional

from pydantic import ValidationError

from tokenpulse.protocol import AlertKind, ExitVerdict, Failure
from worker.agent import gangwatch
from worker.agent.child import describe_exit
from worker.agent.output import last_traceback_frame
from worker.agent.running import Requested, RunningJob

# A data error names the row it could not use: "row 1200", "index 17", "line 88", "example #3". Read
# in the exception's own words only (never in the output around it, where "step 12" abounds).
ROW = re.compile(r"\b(?:row|index|line|example|sample|record|item|idx)s?\s*(?:#|no\.?|number|=|:)?\s*(\d+)",
                 re.IGNORECASE)
# ... and comes from reading, tokenizing or collating data (not from a shape mismatch in the model)
DATA_WORDS = re.compile(r"collat|tokeni|dataset|column|json|csv|parquet|decode|encod|data|row|line \d+ of|"
                        r"field|schema|parse", re.IGNORECASE)
# A collective that timed out (NCCL's watchdog, gloo, torch.distributed's store): transient, retried.
COLLECTIVE = re.compile(r"(Watchdog caught collective operation timeout|NCCL.*time(d)? ?out|"
                        r"collective operation timeout|ProcessGroup\w*.*[Tt]imed? ?out|"
                        r"Socket Timeout|DistStoreError.*[Tt]imed? ?out|gloo.*[Tt]imed? ?out)")
EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)\b:?.*")


def data_error(message: Optional[str]) -> Optional[str]:
    """'row 1003' when an exception's message names the row (index, line) of data it could not use."""
    if not message:
        return None
    m = ROW.search(message)
    if m is None or not DATA_WORDS.search(message):
        return None
    return m.group(0).strip()


def exception_line(lines: list[str]) -> Optional[str]:
    """The last traceback's exception line ("ValueError: bad row 12") in a process's stderr."""
    for line in reversed(lines):
        if line and not line[0].isspace() and EXCEPTION.match(line.strip()):
            return line.strip()
    return None


def final_verdict(rj: RunningJob, returncode: int, agent_name: str) -> ExitVerdict:
    """The exit judged, a gang's failing rank named and each rank's end, and for a crash where the
    job had got to; then classed for the retry policy: a data error naming its row, a collective's
    timeout, an out of memory with the peak memory the attempt reached."""
    verdict = judge_exit(rj, returncode, agent_name)
    verdict = classify(rj, verdict)
    if rj.gang is not None and rj.requested is None and verdict.state != "queued":  # not a preemption
        verdict = gangwatch.judge(rj.gang, verdict, list(rj.process.tail))
    if rj.gang is not None:
        verdict.ranks = gangwatch.exits(rj.gang, list(rj.process.tail))
    if verdict.state == "failed" and verdict.failure in (Failure.CRASH, Failure.SIGNAL):
        d = rj.detector
        ago = time.time() - d.last_progress if d.last_progress else 0
        verdict.reason = (f"{verdict.reason or ''}\nlast progress: {d.where()}, "
                          f"{ago:.0f} s before the exit")[-8000:]
    return verdict


def classify(rj: RunningJob, verdict: ExitVerdict) -> ExitVerdict:
    """The failure's class, where the exit alone does not say it (the retry policy cures by class)."""
    if verdict.state != "failed":
        return verdict
    if verdict.failure in (Failure.CRASH, Failure.ERROR):
        said = (verdict.reason or "").split("\n")[0] if rj.command is None else \
            exception_line(list(rj.stderr_tail)) or ""
        row = data_error(said)
        if row is not None:  # it would fail on the same row again
            verdict.failure, verdict.retry = Failure.DATA, False
            verdict.reason = f"data error naming {row}: not retried (the same data fails the same way)\n" \
                             f"{verdict.reason or ''}"[:8000]
            return verdict
    if verdict.failure in (Failure.CRASH, Failure.SIGNAL) and COLLECTIVE.search(
            f"{verdict.reason or ''}\n" + "\n".join(list(rj.process.tail)[-40:])):
        verdict.failure, verdict.retry = Failure.COLLECTIVE_TIMEOUT, True
    if verdict.failure == Failure.OOM and verdict.peak_mb is None and rj.sys is not None:
        peak = rj.sys.peak_gpu_mb or rj.sys.peak_rss_mb  # the agent's own samples of the tree
        verdict.peak_mb = round(peak, 1) if peak else None
    return verdict


def judge_exit(rj: RunningJob, returncode: int, agent_name: str) -> ExitVerdict:
    code, sig, words = describe_exit(returncode)
    child = rj.child_state or {}
    said = child.get("state")
    what = "command" if rj.command is not None else "training process"
    if rj.requested == Requested.HANG and rj.hang is not None:  # stalled past stall.kill_after_s: killed
        h = rj.hang
        return ExitVerdict(state="failed", failure=Failure.HANG, retry=True, exit_code=code, signal=sig,
                           step=h.get("step"), frame=(h.get("frame") or "")[:500] or None,
                           reason=f"hung: {h.get('headline') or 'stalled'}; killed {rj.kill_after_s:g} s after its "
                                  f"stall alert (stall.kill_after_s)")
    if said == "queued" and child.get("failure") == Failure.PREEMPTED and rj.requested != Requested.CANCEL:
        # a SIGTERM from outside (a preemption): it checkpointed where it could and asks to come back
        return ExitVerdict(state="queued", failure=Failure.PREEMPTED, exit_code=code, signal=sig,
                           reason=str(child.get("reason") or f"preempted; {what} {words}"))
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
        for kind in list(rj.advice.open) + ([AlertKind.QUIET] if rj.advice.quiet.open else []):
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
