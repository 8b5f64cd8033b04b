"""Fixes: a verdict's remedy (an alert's data["fixes"], built by worker/agent/fixes.py or the training
process) applied to its job, and whether it paid off.

- request(): the fix chosen (by alert, alert kind, or the n-th of the job's open fixes), checked as a
  spec (pydantic: a 422 naming the field), kept as a job_changes row 'pending', and a pause asked for;
  the pause's end (store.settle_change) swaps the spec and requeues the job at once: from the pause's
  checkpoint, or from step 0 where the change makes it unusable (the fix says so beforehand). A paused
  or queued job gets the change at once.
- revert(): the newest applied change undone the same way.
- compare(): before/after from the stored metric series (server/series.py): the attempt's last steps
  before the change (kept in the row when it is asked for) against the new attempt's own points (each
  attempt keeps its points: a fresh start never overwrites the steps it repeats) once WARMUP_STEPS
  are behind it, with a verdict.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from typing import Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from server import store
from server.dialect import raw_cursor
from server.models import Alert, Job, JobChange, MetricKey, Token
from server.series import read_run, read_series
from server.store import TransitionError
from server.validate import check_spec_async
from tokenpulse.errors import SpecError
from tokenpulse.protocol import (
    ACTIVE_STATES,
    COMMAND,
    EXTERNAL,
    LAYOUT_FIELDS,
    LAYOUT_FRESH,
    FixKind,
    JobState,
    load_spec,
)

WARMUP_STEPS = 3  # a new attempt's first steps (loading, caches, the allocator) are not its pace
MIN_STEPS = 4  # measured steps after the warm-up before a verdict
BEFORE_STEPS = 50  # the window of steps before the change
AFTER_STEPS = 200  # ... and after it, past the warm-up: the comparison reads these, never a whole run
PENDING_S = 600.0  # a fix whose pause has not ended by then may be replaced by another
LOSS_STEPS = 2000  # losses by step kept from before a change (for the loss at equal steps)
FASTER = 1.1  # a ratio above this is "faster" (a busy machine's noise is below it); below, "no better"
LOSS_SAME = 0.05  # losses within 5 % at equal steps are "unchanged"
METRICS = ("tokens_per_s", "step_time_s", "loss", "eta_s", "rss_mb", "cuda_peak_mb")


# ---- which fix -----------------------------------------------------------------------------------

def open_fixes(s: Session, job: Job) -> list[tuple[Alert, dict]]:
    """Every fix the job's open verdicts carry, in the order `tokenpulse fix <job> <n>` numbers them."""
    alerts = s.scalars(select(Alert).where(Alert.job_id == job.id, Alert.state != "cleared",
                                           Alert.data.is_not(None)).order_by(Alert.id))
    return [(a, f) for a in alerts for f in (json.loads(a.data or "{}").get("fixes") or []) if isinstance(f, dict)]


def choose(s: Session, job: Job, alert_id: Optional[int], kind: Optional[str], n: int) -> tuple[Alert, dict]:
    """The fix asked for: of one alert (by id, or the job's open alert of that kind; kind may also
    name a fix kind), else of all the job's open fixes; n counts from 1."""
    fixes = open_fixes(s, job)
    if alert_id is not None:
        a = s.get(Alert, alert_id)
        if a is None or a.job_id != job.id:
            raise SpecError("alert_id", f"job {job.id} has no alert {alert_id}")
        fixes = [(a, f) for f in (json.loads(a.data or "{}").get("fixes") or [])]
        if not fixes:
            raise SpecError("alert_id", f"alert {alert_id} ({a.kind}) carries no fix: its verdict names none "
                                        "that can be applied as a change")
    elif kind is not None:
        fixes = [(a, f) for a, f in fixes if kind in (a.kind, f.get("kind"))]
        if not fixes:
            raise SpecError("kind", f"job {job.id} has no open verdict '{kind}' with a fix")
    if not fixes:
        raise TransitionError(f"job {job.id} has no open verdict with a fix to apply")
    if n > len(fixes):
        raise SpecError("n", f"there {'is' if len(fixes) == 1 else 'are'} {len(fixes)} "
                        f"fix{'es' if len(fixes) != 1 else ''} to choose from; n must be 1..{len(fixes)}")
    return fixes[n - 1]


# ---- the change as a spec ------------------------------------------------------------------------

def changed_spec(job: Job, fix: dict) -> tuple[str, dict]:
    """The job's spec with the fix's changes (as JSON), and the changes with the spec's actual old
    values. A change that fails the spec's checks is a SpecError naming the field."""
    spec = json.loads(job.spec)
    changes = fix.get("changes") or {}
    if not isinstance(changes, dict) or not changes:
        raise SpecError("changes", "the fix names no change")
    actual: dict = {}
    if job.kind == COMMAND:
        argv = fix.get("argv")
        if not (isinstance(argv, list) and len(argv) == 2 and isinstance(argv[1], list)):
            raise SpecError("argv", "a command job's fix must give its new argv")
        actual = dict(changes)
        spec["command"] = argv[1]
    else:
        model = load_spec(job.kind, job.spec)
        for name, pair in changes.items():
            if name not in type(model).model_fields:
                raise SpecError(name, f"'{name}' is not a setting of this job")
            if not (isinstance(pair, list) and len(pair) == 2):
                raise SpecError(name, "a change is [old, new]")
            if isinstance(pair[1], float) and not math.isfinite(pair[1]):
                raise SpecError(name, f"{pair[1]} is not a finite number")
            actual[name] = [spec.get(name), pair[1]]
            spec[name] = pair[1]
        if all(old == new for old, new in actual.values()):
            raise TransitionError(f"job {job.id} already runs with {_pairs(actual)}")
    try:
        new = load_spec(job.kind, json.dumps(spec))
    except ValueError as e:
        errs = getattr(e, "errors", lambda: [])()
        name = ".".join(map(str, errs[0]["loc"])) if errs and errs[0].get("loc") else next(iter(changes))
        raise SpecError(name or "changes", errs[0]["msg"] if errs else str(e)) from e
    return new.model_dump_json(), actual


async def check_like_a_submit(job: Job, spec_after: str, settings) -> None:
    """A fix's new spec passes what a submit's passes (server/validate.py: paths under path_roots,
    existing model and dataset, no credential in a command's env): a SpecError (422) naming the field.
    Run off the writer, before the change is kept."""
    if job.kind == EXTERNAL:
        return
    await check_spec_async(load_spec(job.kind, spec_after), settings)


def _pairs(changes: dict) -> str:
    return ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in changes.items())


# ---- asking for it -------------------------------------------------------------------------------

def request(s: Session, job: Job, fix: dict, alert_id: Optional[int], by: Optional[int],
            kind: Optional[str] = None, reverts: Optional[int] = None) -> JobChange:
    """Keep the change (pending) and ask for the pause whose end applies it (store.settle_change);
    a paused or queued job is changed at once. 409 (TransitionError) where the state does not allow it."""
    state = JobState(job.state)
    if state not in ACTIVE_STATES and state not in (JobState.paused, JobState.queued):
        raise TransitionError(f"job {job.id} is {state.value}; a fix applies to a running, paused or queued job "
                              "(clone this one with the change instead)")
    now = time.time()
    waiting = s.scalar(select(JobChange).where(JobChange.job_id == job.id, JobChange.state == "pending"))
    if waiting is not None and now - waiting.created_at < PENDING_S:
        raise TransitionError(f"job {job.id} is already being changed: a fix waits for its checkpoint")
    if waiting is not None:  # its pause never came (a command that could not pause after all): replaced
        waiting.state = "dropped"
        waiting.verdict = json.dumps({"verdict": f"not applied: no checkpoint within {PENDING_S / 60:.0f} min"})
    spec_after, actual = changed_spec(job, fix)
    settle_previous(s, job)
    resume = "fresh" if fix.get("resume") == "fresh" else "checkpoint"
    if job.kind != COMMAND and any(k in LAYOUT_FIELDS for k in actual):
        # whatever the fix said: a resumed training process keeps its checkpoint's layout (session.py)
        resume, fix = "fresh", dict(fix, why_fresh=fix.get("why_fresh") or LAYOUT_FRESH)
    full = dict(fix, changes=actual, spec_after=spec_after, spec_before=job.spec)
    change = JobChange(job_id=job.id, kind=kind or str(fix.get("kind") or "change")[:32], state="pending",
                       alert_id=alert_id, reverts=reverts, changes=json.dumps(actual), fix=json.dumps(full),
                       resume=resume, by_token_id=by, created_at=now,
                       before=json.dumps(snapshot(s, job)))
    s.add(change)
    s.flush()
    if state in ACTIVE_STATES:
        store.request_pause(s, job)  # its end (paused, checkpoint saved) relaunches: store.settle_change
    else:
        store.settle_change(s, job, JobState.paused if state == JobState.paused else JobState.queued, None, now)
    return change


def revert(s: Session, job: Job, by: Optional[int]) -> JobChange:
    """Undo the newest applied fix not undone yet: the same pause and relaunch, from the newest
    checkpoint (from step 0 where the fix changed the batch layout: the checkpoint holds the new one)."""
    undone = set(s.scalars(select(JobChange.reverts).where(JobChange.job_id == job.id,
                                                           JobChange.reverts.is_not(None))))
    last = s.scalar(select(JobChange).where(JobChange.job_id == job.id, JobChange.state == "applied",
                                            JobChange.kind != FixKind.REVERT, JobChange.id.not_in(undone or {0}))
                    .order_by(JobChange.id.desc()).limit(1))
    if last is None:
        raise TransitionError(f"job {job.id} has no applied fix to revert")
    fix = json.loads(last.fix)
    back = {"kind": FixKind.REVERT, "title": f"revert #{last.id}: {fix.get('title') or last.kind}",
            "changes": {k: [v[1], v[0]] for k, v in json.loads(last.changes).items()},
            "effect": "back to the settings before the fix", "resume": last.resume,
            "why_fresh": fix.get("why_fresh")}
    if job.kind == COMMAND and isinstance(fix.get("argv"), list):
        back["argv"] = [fix["argv"][1], fix["argv"][0]]
    return request(s, job, back, None, by, kind=FixKind.REVERT, reverts=last.id)


def clear_reason(s: Session, job: Job, d: dict) -> dict:
    """An alert cleared because its attempt stopped for a fix says so: the process ended (paused) for
    the fix, and the new attempt is judged afresh."""
    change = s.scalar(select(JobChange).where(JobChange.job_id == job.id, JobChange.state == "pending"))
    if change is None:
        return d
    title = json.loads(change.fix).get("title") or change.kind
    return {**d, "message": f"fix #{change.id} applied ({title}); the new attempt is judged afresh"}


def settle_previous(s: Session, job: Job) -> None:
    """Before a new change: the previous one's comparison kept in its row (its window of steps after
    ends where the new change begins)."""
    prev = s.scalar(select(JobChange).where(JobChange.job_id == job.id, JobChange.state == "applied",
                                            JobChange.verdict.is_(None)).order_by(JobChange.id.desc()).limit(1))
    if prev is not None:
        prev.verdict = json.dumps(compare(s, prev, None))


# ---- measuring -----------------------------------------------------------------------------------

def _series(s: Session, job_id: int, attempt: int, after_step: Optional[int], before_step: Optional[int],
            own: bool = False) -> dict:
    """Every point of METRICS in (after_step, before_step]: a bounded window, never a whole long run;
    as the attempt ran it (with the steps it resumed after), or own: its own points alone."""
    keys = dict(s.execute(select(MetricKey.name, MetricKey.id).where(MetricKey.name.in_(METRICS))).all())
    cur = raw_cursor(s)
    out = {}
    for name, kid in keys.items():
        read = read_series if own else read_run
        ser = read(cur, job_id, kid, attempt, 1_000_000, "minmax", after_step, before_step)
        if ser is not None:
            out[name] = list(zip(ser["step"], ser["value"], ser["t"]))
    return out


def snapshot(s: Session, job: Job) -> dict:
    """The job's pace over its last BEFORE_STEPS steps (warm-up left out), and its losses by step (for
    the loss at equal steps after a fresh start)."""
    ser = _series(s, job.id, job.attempt, max(0, (job.step or 0) - LOSS_STEPS), None)
    return summarize(ser, lambda step, t: step > WARMUP_STEPS, BEFORE_STEPS, keep_loss=True,
                     attempt=job.attempt)


def summarize(ser: dict, keep, last_n: Optional[int], keep_loss: bool = False, attempt=None) -> dict:
    pts = {k: [(st, v) for st, v, t in rows if keep(st, t) and v is not None] for k, rows in ser.items()}
    steps = sorted({st for rows in pts.values() for st, _ in rows})
    if last_n is not None:
        steps = steps[-last_n:]
    window = set(steps)

    def vals(name):
        return [v for st, v in pts.get(name, []) if st in window]
    out: dict = {"attempt": attempt, "steps": [steps[0], steps[-1]] if steps else None, "n": len(steps)}
    for name, how in (("tokens_per_s", statistics.median), ("step_time_s", statistics.median),
                      ("rss_mb", max), ("cuda_peak_mb", max)):
        v = vals(name)
        out[name] = float(how(v)) if v else None
    eta = vals("eta_s")
    out["eta_s"] = float(eta[-1]) if eta else None
    losses = [(st, v) for st, v in pts.get("loss", []) if st in window]
    out["loss"] = float(statistics.mean(v for _, v in losses[-10:])) if losses else None
    if keep_loss:
        out["loss_by_step"] = {str(st): v for st, v in pts.get("loss", [])[-LOSS_STEPS:]}
    return out


def compare(s: Session, change: JobChange, next_applied: Optional[float]) -> dict:
    """Before/after of an applied change; 'verdict' None until the new attempt has run MIN_STEPS
    steps past its warm-up. After-steps: written since the relaunch (and before the next change)."""
    before = json.loads(change.before or "{}")
    first = (change.resume_step or 0) + WARMUP_STEPS
    end = next_applied or float("inf")
    # the new attempt's own points (to_attempt): an earlier attempt's at the same steps are not "after"
    ser = _series(s, change.job_id, change.to_attempt or 0, change.resume_step or 0, first + AFTER_STEPS, own=True)
    after = summarize(ser, lambda step, t: step > first and change.applied_at <= t < end, None,
                      attempt=change.to_attempt)
    out: dict = {"before": {k: v for k, v in before.items() if k != "loss_by_step"}, "after": after,
                 "warmup_steps": WARMUP_STEPS, "verdict": None, "speedup": None}
    # loss at equal steps: the same steps before and after (a fresh start repeats them)
    old = before.get("loss_by_step") or {}
    same = [(v, old[str(st)]) for st, v, t in ser.get("loss", []) if str(st) in old and change.applied_at <= t < end
            and st > first]
    if same:
        a, b = statistics.mean(x for x, _ in same), statistics.mean(y for _, y in same)
        out["loss_equal_steps"] = {"steps": len(same), "before": b, "after": a}
    if after["n"] < MIN_STEPS:
        out["verdict"] = None
        out["waiting"] = f"measuring: {after['n']} of {MIN_STEPS} steps after the {WARMUP_STEPS} warm-up steps"
        return out
    ratio = None
    if before.get("tokens_per_s") and after.get("tokens_per_s"):
        ratio = after["tokens_per_s"] / before["tokens_per_s"]
    elif before.get("step_time_s") and after.get("step_time_s"):
        ratio = before["step_time_s"] / after["step_time_s"]
    out["speedup"] = ratio
    loss = ""
    eq = out.get("loss_equal_steps")
    if eq and eq["before"]:
        d = (eq["after"] - eq["before"]) / abs(eq["before"])
        loss = ", loss unchanged" if abs(d) <= LOSS_SAME else \
            f", loss {'higher' if d > 0 else 'lower'} by {abs(d):.0%} at equal steps"
    elif before.get("loss") and after.get("loss"):
        d = (after["loss"] - before["loss"]) / abs(before["loss"])
        loss = ", loss no worse" if d <= LOSS_SAME else f", loss higher by {d:.0%}"
    mem = ""
    b_mem = before.get("cuda_peak_mb") or before.get("rss_mb")
    a_mem = after.get("cuda_peak_mb") or after.get("rss_mb")
    if b_mem and a_mem and abs(a_mem - b_mem) / b_mem >= 0.1:
        mem = f", memory {b_mem:,.0f} -> {a_mem:,.0f} MiB"
    job = s.get(Job, change.job_id)
    out.update(pace(before, after, (json.loads(job.info) if job and job.info else {}).get("tokens")))
    if ratio is None:
        out["verdict"] = "measured, but neither tokens/s nor step time to compare"
    elif change.kind == FixKind.REVERT:
        out["verdict"] = f"reverted: {ratio:.2f}x the fixed pace{loss}{mem}"
    elif ratio >= FASTER:
        out["verdict"] = f"verified: {faster(ratio, before, after, out)}{loss}{mem}"
    else:
        out["verdict"] = f"no better: {ratio:.2f}x{loss}{mem}; revert?"
    out["verified"] = ratio is not None and ratio >= FASTER
    return out


def pace(before: dict, after: dict, epoch_tokens) -> dict:
    """The real tokens a step carries, and an epoch's time (the job's tokens at the real tokens/s),
    before and after: a layout change (packing) may make each step carry more tokens in the same
    time, so the same number of steps takes as long while an epoch takes fewer of them."""
    out: dict = {}
    b_tps, a_tps = before.get("tokens_per_s"), after.get("tokens_per_s")
    b_st, a_st = before.get("step_time_s"), after.get("step_time_s")
    if b_tps and a_tps and b_st and a_st:
        out["tokens_per_step"] = {"before": b_tps * b_st, "after": a_tps * a_st}
    if b_tps and a_tps and isinstance(epoch_tokens, (int, float)) and epoch_tokens > 0:
        out["epoch_s"] = {"before": epoch_tokens / b_tps, "after": epoch_tokens / a_tps}
    return out


def faster(ratio: float, before: dict, after: dict, paced: dict) -> str:
    """What got faster, in words: the real tokens per second; then either the tokens each step carries
    (packing: "each step carries 4.0x the real tokens in about the same time: an epoch takes 4.0x
    fewer steps (40 min -> 10 min), the same number of steps about as long") or a step's time; and an
    epoch's time where the job's tokens are known."""
    b, a = before.get("tokens_per_s"), after.get("tokens_per_s")
    words = f"{ratio:.1f}x the real tokens/s ({b:,.0f} -> {a:,.0f})" if b and a else f"{ratio:.1f}x faster steps"
    epoch = paced.get("epoch_s")
    spent = f"{_dur(epoch['before'])} -> {_dur(epoch['after'])}" if epoch else None
    per = paced.get("tokens_per_step")
    if per is None:
        return words + (f"; an epoch {spent}" if spent else "")
    carries, quicker = per["after"] / per["before"], before["step_time_s"] / after["step_time_s"]
    took = (f"{quicker:.1f}x less time" if quicker >= FASTER else
            f"{1 / quicker:.1f}x the time" if quicker <= 1 / FASTER else "about the same time")
    if carries >= FASTER:  # a step holds more real tokens: fewer steps to an epoch
        same = "about as long" if took == "about the same time" else f"in {took}"
        return (f"{words}; each step carries {carries:.1f}x the real tokens in {took}: an epoch takes "
                f"{carries:.1f}x fewer steps{f' ({spent})' if spent else ''}, the same number of steps {same}")
    return (f"{words}: each step takes {took} ({before['step_time_s']:.3g} s -> {after['step_time_s']:.3g} s)"
            + (f", an epoch {spent}" if spent else ""))


def _dur(seconds: float) -> str:
    """As the page's TP.dur writes it: "45 s", "6 min 40 s", "2 h 5 min", "3 d 4 h"."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def change_dict(c: JobChange, comparison: Optional[dict], by_name: Optional[str] = None) -> dict:
    fix = json.loads(c.fix)
    return {"id": c.id, "job_id": c.job_id, "kind": c.kind, "state": c.state, "alert_id": c.alert_id,
            "reverts": c.reverts, "title": fix.get("title"), "changes": json.loads(c.changes),
            "argv": fix.get("argv"), "effect": fix.get("effect"), "resume": c.resume,
            "why_fresh": fix.get("why_fresh"), "by": c.by_token_id, "by_name": by_name, "created_at": c.created_at,
            "applied_at": c.applied_at, "from_attempt": c.from_attempt, "to_attempt": c.to_attempt,
            "resume_step": c.resume_step, "comparison": comparison}


def history(s: Session, job_id: int) -> list[dict]:
    """Every change of the job, oldest first, each with its comparison (live for the newest applied;
    as kept for the earlier ones)."""
    rows = list(s.scalars(select(JobChange).where(JobChange.job_id == job_id).order_by(JobChange.id)))
    who = {c.by_token_id for c in rows if c.by_token_id is not None}  # "by ci-bot", not "by token 3"
    names = dict(s.execute(select(Token.id, Token.name).where(Token.id.in_(who))).all()) if who else {}
    out = []
    for i, c in enumerate(rows):
        later = [r.applied_at for r in rows[i + 1:] if r.applied_at]
        if c.state != "applied":
            cmp = json.loads(c.verdict) if c.verdict else None
        elif c.verdict and later:
            cmp = json.loads(c.verdict)
        else:
            cmp = compare(s, c, later[0] if later else None)
        out.append(change_dict(c, cmp, names.get(c.by_token_id)))
    return out
