"""The real-world corpus benchmark (issue 35): training programs run unchanged as command jobs on a
real server and agent with tokenpulse's default stall settings (bench/realworld/corpus.py lists them:
Lightning, a Trainer reporting to TensorBoard or wandb, TRL's CLI, a script Accelerate ships, loops
of our own in the styles people write). Per program, a healthy run: where its steps, loss and tokens
came from, final step exact, loss equal to the script's own numbers at the same steps, tokens/s, eval
loss, false alerts. Then injected faults (a hang in the data function within the first 2 s of
training and later, SIGSTOP, a hang in evaluation, a collate deadlock): detected within
max(10 x step, 30 s) + 5 s, naming the function.

    python bench/realworld.py                  # every program, every fault it takes
    python bench/realworld.py --quick          # every program healthy; faults on three programs
    python bench/realworld.py --programs "Lightning self.log;mlflow loop" --faults sigstop
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench" / "realworld"))
sys.path.insert(0, str(ROOT))
from conftest import make_server, stop_agents  # noqa: E402  (the tests' real-process fixtures)
from corpus import PROGRAMS, Program, matches, printed_numbers, said_source  # noqa: E402
from detection import wait_for  # noqa: E402  (poll until truthy, else None)
from test_instrument import make_tiny_model  # noqa: E402  (the tests' tiny Llama)

OVER = ("completed", "failed", "cancelled")
TRUE_VERDICTS = ("truncation", "padding")


@dataclass
class Fault:
    name: str
    what: str
    args: tuple  # the program's own arguments that make it (each program of ours takes them)
    cause: tuple  # any of these in the alert's message or stack: the function it hangs in


FAULTS = {f.name: f for f in [
    Fault("data_early", "a hang in the data function within the first 2 s of training", ("--hang-data-after-s", "1.5"),
          ("get_batch", "make_example")),
    Fault("data_late", "a hang in the data function later", ("--hang-data-at", "25"), ("get_batch", "make_example")),
    Fault("sigstop", "the training process frozen by SIGSTOP", (), ("SIGSTOP", "stopped")),
    Fault("eval_hang", "a hang in evaluation", ("--hang-eval",), ("evaluate", "validation_step", "evaluation")),
    Fault("collate", "a collate deadlock", ("--hang-collate-at", "12"), ("collate", "collator")),
]}
TRAINER_COLLATE = ("--collator-block-at", "40")  # hf_trainer.py's own option: past its first steps
QUICK = ("print loop (GradScaler, accumulation)", "Lightning self.log", "Trainer report_to=tensorboard")


class Bench:
    def __init__(self, tiny_model: Path):
        self.tmp = Path(tempfile.mkdtemp(prefix="tp-bench-realworld-"))
        self.s = make_server(self.tmp, agent_lost_after_s=15)
        self.s.start()
        self.s.start_agent("a1", "--allow-commands", env={"OMP_NUM_THREADS": "1"})
        self.c = self.s.client()
        self.model = tiny_model
        self.typical: dict[str, float] = {}

    def submit(self, prog: Program, tmp: Path, args: tuple = (), env: dict | None = None) -> int:
        tmp.mkdir(parents=True, exist_ok=True)
        spec = {"name": prog.name, "command": prog.argv(tmp, self.model) + list(args), "cwd": str(tmp),
                "max_retries": 0, "env": {**prog.env(tmp), **(env or {})}}
        r = self.c.post("/api/jobs/command", json=spec)
        r.raise_for_status()
        return r.json()["id"]

    def job(self, jid: int) -> dict:
        return self.c.get(f"/api/jobs/{jid}").json()

    def alerts(self, jid: int) -> list[dict]:
        """Its alerts but the informational ones and the data verdicts that are true of the demo data
        (a fifth of its rows are longer than the 64 tokens the Trainer scripts cut them to, and batches
        padded to their longest row are half padding)."""
        return [a for a in self.c.get("/api/alerts", params={"job_id": jid}).json()
                if a["severity"] != "info" and a["kind"] not in TRUE_VERDICTS]

    def series(self, jid: int, key: str) -> dict[int, float]:
        s = self.c.get(f"/api/jobs/{jid}/metrics", params={"keys": [key]}).json()["series"].get(key)
        return dict(zip(s["step"], s["value"])) if s else {}

    def healthy(self, prog: Program) -> dict:
        tmp = self.tmp / f"healthy-{len(self.typical)}-{time.monotonic_ns()}"
        t0 = time.time()
        jid = self.submit(prog, tmp)
        j = wait_for(lambda: (lambda j: j if j["state"] in OVER else None)(self.job(jid)), 900) or self.job(jid)
        info = j.get("info") or {}
        loss = self.series(jid, prog.loss) if prog.loss else {}
        if prog.own or prog.printed_step_offset is not None:
            if prog.own:
                own = prog.own_numbers(tmp)
            else:  # the numbers it printed
                logs = self.c.get(f"/api/jobs/{jid}/logs", params={"limit": 100000}).json()["lines"]
                own = printed_numbers(prog, [x["line"] for x in logs])
            both = [s for s in own if s in loss]  # at the same steps: "yes (4 of its 4 logged steps)"
            same = both and matches({s: loss[s] for s in both}, {s: own[s] for s in both}, prog.printed_places)
            equal = f"{'yes' if same else 'no'} ({len(both)} of {len(own)})"
        elif prog.loss:  # a Trainer's backend got its numbers: the same as its callback's, at the same steps
            callback = self.series(jid, "loss")
            same = loss and all(round(callback.get(s, -1), 4) == round(v, 4) for s, v in loss.items())
            equal = "yes" if same else "no"
        else:
            equal = "n/a"
        steps_t = self.series(jid, "step_time_s")
        if steps_t:
            self.typical[prog.name] = statistics.median(steps_t.values())
        tokens = bool(self.series(jid, "tokens_per_s"))
        return {"program": prog.name, "state": j["state"], "seconds": round(time.time() - t0),
                "steps_from": "Trainer callback" if info.get("trainer") else "torch hooks",
                "loss_from": said_source(info, prog.loss) or ("Trainer" if info.get("trainer") and loss else "–"),
                "tokens_from": "forward (input ids)" if tokens else "–",
                "final_step": f"{j.get('step')} of {prog.steps}" if prog.steps else str(j.get("step")),
                "step_exact": "n/a" if prog.steps is None else "yes" if j.get("step") == prog.steps else "no",
                "loss_equal": equal, "tokens_s": "yes" if tokens else ("no" if prog.lm else "n/a"),
                "eval_loss": "n/a" if not prog.eval_loss else "yes" if self.series(jid, prog.eval_loss) else "no",
                "false_alerts": len(self.alerts(jid)),
                "note": "; ".join(f"{a['kind']}: {a['message'].splitlines()[0][:80]}" for a in self.alerts(jid))}

    def fault(self, prog: Program, f: Fault) -> dict:
        tmp = self.tmp / f"{f.name}-{time.monotonic_ns()}"
        args = f.args
        if prog.name.startswith("Trainer") and f.name == "collate":
            args = TRAINER_COLLATE
        elif prog.name.startswith("Trainer") and f.name == "eval_hang":
            args = ("--block-at-step", "6")  # not an eval hang in the script: the bench cannot make one there
        mark = tmp / "mark"
        jid = self.submit(prog, tmp, prog.run_long + tuple(args), env={"FAULT_MARK": str(mark)})
        typical = self.typical.get(prog.name, 0.1)
        limit = max(10 * typical, 30) + 5
        if f.name == "sigstop":
            pid = wait_for(lambda: (self.job(jid).get("step") or 0) >= 10 and _pid_of(tmp), 300)
            if pid:
                mark.write_text(str(time.time()))
                os.kill(pid, signal.SIGSTOP)
        if not wait_for(mark.exists, 300, every=0.2):
            j = self.job(jid)
            self.stop(jid, None)
            return {"program": prog.name, "fault": f.name, "detected": "no", "latency": "–", "limit": round(limit),
                    "cause": "no", "note": f"the fault never struck (job {j['state']}, step {j.get('step')})"}
        t_fault = float(mark.read_text())
        a = wait_for(lambda: next((x for x in self.alerts(jid) if x["kind"] == "stalled"), None), max(120, 3 * limit))
        self.stop(jid, _pid_of(tmp) if f.name == "sigstop" else None)
        if not a:
            j = self.job(jid)
            return {"program": prog.name, "fault": f.name, "detected": "no", "latency": "–", "limit": round(limit),
                    "cause": "no", "note": f"no stalled alert (job {j['state']}, step {j.get('step')})"}
        latency = a["created_at"] - t_fault
        named = any(c in a["message"] for c in f.cause)  # the alert itself names it, not only its stack
        return {"program": prog.name, "fault": f.name, "detected": "yes" if latency <= limit else "late",
                "latency": f"{latency:.0f}", "limit": round(limit), "cause": "yes" if named else "no",
                "note": a["message"].splitlines()[0][:100]}

    def stop(self, jid: int, stopped_pid) -> None:
        if stopped_pid:
            try:
                os.kill(stopped_pid, signal.SIGCONT)  # a frozen process cannot be cancelled
            except ProcessLookupError:
                pass
        if self.job(jid)["state"] not in OVER:
            self.c.post(f"/api/jobs/{jid}/cancel")
        wait_for(lambda: self.job(jid)["state"] in OVER, 90)

    def close(self) -> None:
        self.c.close()
        stop_agents(self.s)
        self.s.kill()


def _pid_of(tmp: Path):
    """The program's training process: the one whose command line names its directory's record file
    (or its directory, for a Trainer script), deepest first (a launcher's child trains)."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(tmp) in cmd and "python" in cmd:
            found.append(int(p.name))
    return max(found) if found else None


def table(rows: list[dict], cols: list[str]) -> str:
    width = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    out = ["| " + " | ".join(c.ljust(width[c]) for c in cols) + " |",
           "|" + "|".join("-" * (width[c] + 2) for c in cols) + "|"]
    out += ["| " + " | ".join(str(r.get(c, "")).ljust(width[c]) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="faults on three programs only")
    ap.add_argument("--programs", default="", help="program names separated by ; (default: all)")
    ap.add_argument("--faults", default="", help="comma-separated fault names (default: all each program takes)")
    ap.add_argument("--no-faults", action="store_true")
    a = ap.parse_args()
    names = [n.strip() for n in a.programs.split(";") if n.strip()] or list(PROGRAMS)
    faults = [n.strip() for n in a.faults.split(",") if n.strip()] or list(FAULTS)
    b = Bench(make_tiny_model(Path(tempfile.mkdtemp(prefix="tp-bench-model-")) / "tiny-llama"))
    try:
        healthy = [b.healthy(PROGRAMS[n]) for n in names]
        print(table(healthy, ["program", "steps_from", "loss_from", "tokens_from", "final_step", "step_exact",
                              "loss_equal", "tokens_s", "eval_loss", "false_alerts", "seconds"]), flush=True)
        notes = [f"- {r['program']}: {r['note']}" for r in healthy if r["note"]]
        if notes:
            print("\n".join(notes), flush=True)
        rows = []
        if not a.no_faults:
            for n in names:
                if a.quick and n not in QUICK:
                    continue
                for fname in PROGRAMS[n].faults:
                    if fname in faults:
                        rows.append(b.fault(PROGRAMS[n], FAULTS[fname]))
                        print(rows[-1], flush=True)
            if rows:
                print(table(rows, ["program", "fault", "detected", "latency", "limit", "cause", "note"]))
        ok = all(r["detected"] == "yes" and r["cause"] == "yes" for r in rows)
        ok = ok and all(r["false_alerts"] == 0 and not r["loss_equal"].startswith("no") and r["step_exact"] != "no"
                        for r in healthy)
        print("every goal met" if ok else "NOT every goal met")
        return 0
    finally:
        b.close()


if __name__ == "__main__":
    sys.exit(main())
