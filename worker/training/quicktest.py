"""test_run: the whole job end to end on a few steps before the full run, so a broken config fails in
a minute, not hours in.

The real code runs (a Session on a modified spec, in a temp dir under the output dir): load the
model, tokenize a sample, load the eval data, train TEST_STEPS steps, evaluate, checkpoint, resume
from that checkpoint for one step, save, reload the saved model. Its events are folded into one
`test run` phase (n/total checks); each check's result is a log line and the summary an `info`
(test_run=passed|failed, checks). A failing check fails the job at once as a spec error naming the
check (never retried: the same config would fail again); a pass continues into the full run.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Optional

from tokenpulse.errors import SpecError
from tokenpulse.protocol import JobSpec, Phase

from .errors import Cancelled, clip
from .faults import Faults
from .session import Session

TEST_STEPS = 3
TEST_SAMPLE = 256  # examples tokenized for the test run
TEST_EVAL_EXAMPLES = 32
CHECKS = ["load model", "tokenize a sample", "eval data", "batches", "train", "checkpoint", "eval", "save",
          "resume", "reload"]  # in the order they happen
FIELD = {"load model": "model", "tokenize a sample": "dataset"}


class Observer:
    """The emitter a test-run Session talks to: it learns which check is running from the phases,
    reports them as one `test run` phase, and keeps the rest (metrics, state...) off the job."""

    def __init__(self, em, spec: JobSpec, checks: list[str]):
        self.em, self.spec, self.checks = em, spec, checks
        self.current: Optional[str] = None
        self.passed: set[str] = set()
        self.spent: dict[str, float] = {}
        self.t = time.monotonic()
        self.states: list[dict] = []
        self.checkpoints: list[dict] = []
        self.step_done = None
        self.phase_name = None
        self._relayed = 0.0
        self._loads = 0

    def begin(self, check: str) -> None:
        """`check` is running now; every check before it (they run in order) has passed."""
        if check == self.current or check not in self.checks:
            return
        self._clock()
        for c in self.checks[:self.checks.index(check)]:
            if c not in self.passed:
                self.ok(c)
        self.current = check
        self.em.phase("test run", done=len(self.passed), total=len(self.checks), unit="checks", detail=check)

    def _clock(self) -> None:
        now = time.monotonic()
        if self.current is not None:
            self.spent[self.current] = self.spent.get(self.current, 0.0) + now - self.t
        self.t = now

    def ok(self, check: str) -> None:
        self._clock()
        self.passed.add(check)
        self.em.log(f"test run: ok   {check} ({self.spent.get(check, 0.0):.1f} s)")

    # -- the Emitter interface a Session uses --------------------------------------------------
    def phase(self, name: str, done=None, total=None, unit=None, detail=None) -> None:
        self.phase_name = name
        self._relay(name, done, total, unit)
        if self.current in ("resume", "reload"):
            return  # the resumed run's own phases are all part of the resume check
        check = {"loading model": "load model", "tuning batch size": "batches", Phase.PACKING: "batches",
                 Phase.BATCHING: "batches", Phase.PADDING_TO_MAX: "batches", "training": "train",
                 "evaluating": "eval"}.get(name)
        if name == "loading dataset":  # first the training data, then (eval_dataset / eval_split) the eval data
            self._loads += 1
            check = "tokenize a sample" if self._loads == 1 else "eval data"
        elif name == "saving":
            d = str(detail or "")
            check = "checkpoint" if d.startswith("checkpoint") else "save" if d == "final model" else None
        if check == "train" and self.current in ("checkpoint", "eval"):
            self._clock()
            self.current = "train"  # back to the next step: a failure there is training's
            return
        if check:
            self.begin(check)

    def _relay(self, name, done, total, unit) -> None:
        """The sub-run's progress (tokenizing 120/256...) as the test run's detail, at most every 0.5 s,
        so a long check still shows progress to the stall detector and the page."""
        now = time.monotonic()
        if self.current is None or now - self._relayed < 0.5:
            return
        self._relayed = now
        count = f" {done:,.0f}/{total:,.0f} {unit or ''}".rstrip() if done is not None and total else ""
        self.em.phase("test run", done=len(self.passed), total=len(self.checks), unit="checks",
                      detail=f"{self.current}: {name}{count}")

    def emit(self, kind: str, /, **data) -> None:
        if kind == "state":
            self.states.append(data)
        elif kind == "checkpoint":
            self.checkpoints.append(data)
            if not data.get("final") and self.current == "checkpoint":
                self.ok("checkpoint")
        elif kind == "log":
            self.em.emit("log", **data)

    def metrics(self, step: int, **values) -> None:
        pass  # a non-finite loss ends the sub-run with a failed state, which the check reports

    def info(self, **data) -> None:
        pass

    def alert(self, kind: str, message: str, severity: str = "warning", clear: bool = False) -> None:
        pass

    def log(self, line: str) -> None:
        self.em.log(line)


def test_spec(spec: JobSpec) -> JobSpec:
    return spec.model_copy(update={
        "max_steps": TEST_STEPS, "epochs": None, "checkpoint_every": TEST_STEPS - 1, "checkpoint_every_min": None,
        "keep_checkpoints": 2, "eval_every": None, "eval_every_min": None,
        "eval_max_examples": min(spec.eval_max_examples, TEST_EVAL_EXAMPLES), "warmup_steps": 0,
        "log_every": 1, "test_run": False})


def run_test(spec: JobSpec, out: Path, em, controls, cache_dir: Optional[Path]) -> None:
    """Run the checks; returns when all pass, raises SpecError naming the failing check. Run by
    train.main before the job's own Session, never from inside one."""
    checks = [c for c in CHECKS if spec.has_eval or c not in ("eval data", "eval")]
    tspec = test_spec(spec)
    obs = Observer(em, tspec, checks)
    tmp = Path(out) / ".test-run"
    shutil.rmtree(tmp, ignore_errors=True)
    em.phase("test run", done=0, total=len(checks), unit="checks", detail=f"{TEST_STEPS} steps end to end")
    try:
        s = Session(tspec, tmp, obs, controls, cache_dir=cache_dir, telemetry=False, faults=Faults())
        s.sample = TEST_SAMPLE
        obs.begin("load model")
        s.run()
        if finished(obs, controls):
            return  # paused meanwhile: the full run pauses at its first step
        ckpts = [c for c in obs.checkpoints if not c.get("final")]
        if not ckpts:
            obs.current = "checkpoint"
            raise RuntimeError(f"no checkpoint was written at step {TEST_STEPS - 1}")
        device = s.device
        del s
        obs.begin("resume")
        r = Session(tspec, tmp / "resumed", obs, controls, cache_dir=cache_dir, telemetry=False,
                    resume=Path(ckpts[0]["path"]), faults=Faults())  # the job's test faults are for the full run
        r.sample = TEST_SAMPLE
        n_states = len(obs.states)
        r.run()
        if finished(obs, controls, n_states):
            return
        if r.result is None or r.result.step != TEST_STEPS or len(r.result.losses) != 1:
            raise RuntimeError(f"resuming at step {ckpts[0]['step']} did not train exactly the one step left")
        del r
        obs.begin("reload")
        reload(tmp / "final", device)
        obs.ok("reload")
    except Cancelled:
        raise
    except Exception as e:  # noqa: BLE001 -- whatever broke, the check it broke in is the message
        check = obs.current or "load model"
        why = e.message if isinstance(e, SpecError) else f"{type(e).__name__}: {e}"
        root = root_cause(e)
        if root is not e and str(root) and str(root) not in why:
            why += f" (cause: {type(root).__name__}: {root})"  # e.g. the parse error behind a data error
        em.log(f"test run: FAIL {check}: {why}")
        em.info(test_run="failed", failed_check=check, checks=summary(obs, checks, check, why),
                reason=f"check '{check}' failed: {clip(why, 500)}")
        em.alert("test_run", clip(f"test run failed at check '{check}': {why}", 2000), severity="critical")
        if check == "eval data":
            field = "eval_dataset" if spec.eval_dataset else "eval_split" if spec.eval_split else "eval_fraction"
        else:
            field = FIELD.get(check) or getattr(e, "field", None) or "test_run"
        raise SpecError(field, f"test run failed at check '{check}': {why}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    em.info(test_run="passed", checks=summary(obs, checks),
            reason=f"all {len(checks)} checks passed in {sum(obs.spent.values()):.1f} s; starting the full run")
    em.phase("test run", done=len(checks), total=len(checks), unit="checks", detail="passed")


def root_cause(e: BaseException) -> BaseException:
    seen = {id(e)}
    while (nxt := e.__cause__ or e.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        e = nxt
    return e


def finished(obs: Observer, controls, since: int = 0) -> bool:
    """The sub-run's own last word: True when paused; raises unless it completed."""
    if controls.cancel:
        raise Cancelled()
    states = obs.states[since:]
    last = states[-1] if states else {"state": "failed", "reason": "ended without a result"}
    if last.get("state") == "paused":
        return True
    if last.get("state") != "completed":
        raise RuntimeError(last.get("reason") or last.get("state"))
    return False


def reload(final: Path, device) -> None:
    """The saved model and tokenizer load with from_pretrained alone and compute finite logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(final))
    model = AutoModelForCausalLM.from_pretrained(str(final)).to(device).eval()
    ids = tok("a quick check", return_tensors="pt")["input_ids"].to(device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if not torch.isfinite(logits).all():
        raise RuntimeError("the reloaded model computes non-finite logits")


def summary(obs: Observer, checks: list[str], failed: Optional[str] = None, why: str = "") -> list[dict]:
    out = []
    for c in checks:
        if c in obs.passed:
            out.append({"check": c, "ok": True, "seconds": round(obs.spent.get(c, 0.0), 2)})
        elif c == failed:
            out.append({"check": c, "ok": False, "error": clip(why, 1000)})
        else:
            out.append({"check": c, "ok": None})
    return out
