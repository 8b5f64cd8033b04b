"""The fault benchmark: injected faults in the kinds of script people bring, run unchanged as command
jobs on a real server and agent, with tokenpulse's default stall settings. Per fault and script kind:
detected or not, seconds from the fault to the alert, whether the alert names the right cause (the
user's function and file, and the rank for a distributed script); then healthy runs with irregular
steps (a long first step, slow evaluations, checkpoint saves) that must raise nothing.

    python bench/faults.py                    # every fault in every script kind (~35 min on 2 cores)
    python bench/faults.py --quick            # one script kind per fault, and the healthy runs
    python bench/faults.py --kinds plain,ddp --faults deadlock,sigstop

The scripts are in bench/faults/: plain_loop.py (no Trainer, no tqdm, no tokenpulse calls),
accelerate_loop.py (Accelerate with a DataLoader), trainer_script.py (Hugging Face Trainer with the
user's dataset, collator and callback), ddp_loop.py (torchrun, 2 ranks, gloo). Every fault strikes in
bench/faults/userdata.py, the "user's own" module; it writes the wall-clock time of the fault to a
mark file, from which latency is measured against the alert's creation time on the server.

Goal (issue "every PyTorch script watched as well as a Trainer"): every hang and stall detected, at
least 95% with the right cause, each within max(10 x the job's typical step, 30 s) + 5 s; no alert on
the healthy runs; one open/clear cycle per real condition.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "bench" / "faults"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from conftest import make_server  # noqa: E402  (the tests' real-process fixtures)
from detection import wait_for  # noqa: E402  (poll until truthy, else None)

BIN = Path(sys.executable).parent
STEPS = 400
FAULT_STEP = 15


def argv(kind: str, steps: int = STEPS) -> list[str]:
    if kind == "ddp":
        return [str(BIN / "torchrun"), "--nproc-per-node", "2", str(SCRIPTS / "ddp_loop.py"), str(steps)]
    script = {"plain": "plain_loop", "accelerate": "accelerate_loop", "trainer": "trainer_script"}[kind]
    return [sys.executable, str(SCRIPTS / f"{script}.py"), str(steps)]


@dataclass
class Fault:
    name: str
    what: str
    kinds: tuple[str, ...]
    expect: str  # "stalled": a hang alert; "slow": a slow-job verdict; "failed": the job fails, cause named
    cause: tuple[str, ...]  # any of these in the alert's message or stack: the user's function
    ddp_rank: int = 1  # the rank it strikes in the distributed script (the alert must name it)
    env: dict = field(default_factory=dict)
    steps: int = STEPS  # long enough for the fault to show


ALL = ("plain", "accelerate", "trainer", "ddp")
FAULTS = [
    Fault("deadlock", "a deadlock in the user's data function", ALL, "stalled",
          ("_deadlock", "read_batch", "read_example")),
    Fault("collate_hang", "a collate function that never returns", ALL, "stalled", ("collate",)),
    Fault("skip_collective", "rank 1 skips a collective (the others wait in all_reduce)", ("ddp",), "stalled",
          ("barrier", "all_reduce")),
    Fault("slow_rank", "rank 1 is 3x slower than the others", ("ddp",), "slow", ("rank 1",)),
    Fault("sigstop", "the training process frozen by SIGSTOP", ALL, "stalled", ("SIGSTOP", "stopped", "after_step")),
    Fault("checkpoint_hang", "a hang while saving a checkpoint", ALL, "stalled", ("save_checkpoint",),
          ddp_rank=0),  # the DDP script saves on rank 0 only
    Fault("worker_hang", "a DataLoader worker that hangs", ("accelerate", "trainer"), "stalled",
          ("read_example", "DataLoader", "_worker_loop"), env={"NUM_WORKERS": "1"}),
    Fault("worker_dies", "a DataLoader worker that dies", ("accelerate", "trainer"), "failed",
          ("DataLoader worker",), env={"NUM_WORKERS": "1"}),
    Fault("eval_hang", "an evaluation that never ends", ALL, "stalled", ("evaluate", "read_example", "evaluation")),
    Fault("memory", "CPU memory grows 128 MiB/s to ~4 GiB", ALL, "memory", ("memory", "RSS", "rss"), steps=4000),
]


@dataclass
class Row:
    fault: str
    kind: str
    detected: bool
    latency: float | None
    limit: float
    cause: bool
    note: str


class Bench:
    def __init__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="tp-bench-faults-"))
        self.s = make_server(self.tmp, agent_lost_after_s=15)
        self.s.start()
        self.s.start_agent("a1", "--allow-commands", env={"OMP_NUM_THREADS": "1"})
        self.c = self.s.client()
        self.typical: dict[str, float] = {}

    def submit(self, name: str, kind: str, env: dict, steps: int = STEPS) -> int:
        out = self.tmp / name
        out.mkdir(parents=True, exist_ok=True)
        r = self.c.post("/api/jobs/command", json={
            "name": name, "command": argv(kind, steps), "cwd": str(SCRIPTS), "max_retries": 0,
            "env": {"OUT_DIR": str(out), "FAULT_MARK": str(out / "mark"), "OMP_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **env}})
        r.raise_for_status()
        return r.json()["id"]

    def job(self, jid: int) -> dict:
        return self.c.get(f"/api/jobs/{jid}").json()

    def alerts(self, jid: int) -> list[dict]:
        return self.c.get("/api/alerts", params={"job_id": jid}).json()

    def stop(self, jid: int) -> None:
        for pid in self._stopped:
            try:
                os.kill(pid, signal.SIGCONT)  # a frozen process cannot be cancelled
            except ProcessLookupError:
                pass
        self._stopped = []
        if self.job(jid)["state"] not in ("completed", "failed", "cancelled"):
            self.c.post(f"/api/jobs/{jid}/cancel")
        wait_for(lambda: self.job(jid)["state"] in ("completed", "failed", "cancelled"), 90)

    _stopped: list[int] = []

    def healthy(self, kind: str) -> dict:
        """A healthy run with irregular steps: a long first step, evaluations 40 steps long,
        checkpoint saves. Also measures the script's typical step, the latency goal's unit."""
        name = f"healthy-{kind}-{time.monotonic_ns()}"
        steps = 300
        jid = self.submit(name, kind, {"FIRST_STEP_S": "20", "EVAL_EXTRA_S": "4", "SAVE_EXTRA_S": "2",
                                       "STEP_LOG": str(self.tmp / name / "steps.json")}, steps=steps)
        t0 = time.time()
        over = ("completed", "failed", "cancelled")
        j = wait_for(lambda: (lambda j: j if j["state"] in over else None)(self.job(jid)), 900) or self.job(jid)
        bad = [a for a in self.alerts(jid) if a["severity"] != "info"]
        log = self.tmp / name / "steps.json"
        typical = json.loads(log.read_text())["median_step_s"] if log.exists() else None
        if typical:
            self.typical[kind] = typical
        return {"kind": kind, "state": j["state"], "seconds": round(time.time() - t0), "typical": typical,
                "false": len(bad), "cycles": _cycles(self.alerts(jid)),
                "note": "; ".join(f"{a['kind']}: {a['message'].splitlines()[0][:90]}" for a in bad)}

    def run(self, f: Fault, kind: str) -> Row:
        rank = f.ddp_rank if kind == "ddp" else 0
        name = f"{f.name}-{kind}-{time.monotonic_ns()}"
        out = self.tmp / name
        jid = self.submit(name, kind, {"FAULT": f.name, "FAULT_STEP": str(FAULT_STEP), "FAULT_RANK": str(rank),
                                       "STEP_LOG": str(out / "steps.json"), **f.env}, steps=f.steps)
        typical = self.typical.get(kind, 0.1)
        limit = max(10 * typical, 30) + 5
        marks = lambda: sorted(out.glob("mark.*"))  # noqa: E731
        if not wait_for(marks, 300, every=0.2):
            j = self.job(jid)
            self.stop(jid)
            return Row(f.name, kind, False, None, limit, False,
                       f"the fault never struck (job {j['state']}: {j.get('reason')})")
        t_fault = min(float(p.read_text()) for p in marks())
        if f.name == "sigstop":
            self._stopped = [int(p.read_text()) for p in out.glob("pid.*")]

        def verdict():
            if f.expect == "failed":
                j = self.job(jid)
                if j["state"] in ("failed", "completed", "cancelled"):
                    return {"created_at": j.get("finished_at") or time.time(), "message": j.get("reason") or "",
                            "stack": "", "kind": "failed"}
            for a in self.alerts(jid):
                if a["severity"] == "info":
                    continue
                text = f"{a['message']}\n{a.get('stack') or ''}"
                if f.expect == "stalled" and a["kind"] == "stalled":
                    return a
                if f.expect == "slow" and a["kind"] in ("slow", "straggler"):
                    return a
                if f.expect == "memory" and re.search(r"memory|rss", text, re.I):
                    return a
            return None
        a = wait_for(verdict, max(120, 3 * limit))
        alerts = self.alerts(jid)
        self.stop(jid)
        if not a:
            j = self.job(jid)
            seen = "; ".join(f"{x['kind']}: {x['message'].splitlines()[0][:70]}" for x in alerts) or \
                f"no alert (job {j['state']}, step {j.get('step')}, phase {(j.get('phase') or {}).get('name')})"
            return Row(f.name, kind, False, None, limit, False, seen)
        text = f"{a['message']}\n{a.get('stack') or ''}"
        named = any(c in text for c in f.cause)
        where = (f.name in ("sigstop", "worker_dies", "slow_rank", "memory") or "userdata.py" in text
                 or "ddp_loop.py" in text)
        ranked = kind != "ddp" or f"rank {rank}" in text
        return Row(f.name, kind, True, a["created_at"] - t_fault, limit, named and where and ranked,
                   a["message"].splitlines()[0][:110])

    def close(self):
        self.c.close()
        for a in self.s.agents:
            a.send_signal(signal.SIGTERM)
            try:
                a.wait(30)
            except Exception:
                a.kill()
        self.s.kill()


def _cycles(alerts: list[dict]) -> int:
    """Open/clear cycles of the most repeated (kind) among a job's alerts: 1 means no flapping."""
    by_kind: dict[str, int] = {}
    for a in alerts:
        by_kind[a["kind"]] = by_kind.get(a["kind"], 0) + 1
    return max(by_kind.values(), default=0)


def report(rows: list[Row], healthy: list[dict]) -> str:
    out = ["| fault | script | detected | fault -> alert | goal | right cause | alert / note |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        lat = "-" if r.latency is None else f"{r.latency:.1f} s"
        out.append(f"| {r.fault} | {r.kind} | {'yes' if r.detected else 'NO'} | {lat} | {r.limit:.0f} s | "
                   f"{'yes' if r.cause else 'no'} | {r.note.replace('|', '/')} |")
    out += ["",
            "| healthy run (irregular steps) | state | s | typical step | false alerts | most cycles of one kind | "
            "note |",
            "|---|---|---|---|---|---|---|"]
    for h in healthy:
        out.append(f"| {h['kind']} | {h['state']} | {h['seconds']} | {h['typical'] or '-'} s | {h['false']} | "
                   f"{h['cycles']} | {h['note']} |")
    det = [r for r in rows if r.detected]
    lats = [r.latency for r in det if r.latency is not None]
    in_goal = [r for r in det if r.latency is not None and r.latency <= r.limit]
    out += ["", f"detected {len(det)}/{len(rows)} ({100 * len(det) / max(1, len(rows)):.0f}%); right cause "
                f"{sum(r.cause for r in det)}/{len(rows)} "
                f"({100 * sum(r.cause for r in det) / max(1, len(rows)):.0f}%); "
                f"within the latency goal {len(in_goal)}/{len(rows)}; latency median "
                f"{statistics.median(lats) if lats else float('nan'):.1f} s, worst "
                f"{max(lats, default=float('nan')):.1f} s; "
                f"false alerts on healthy runs {sum(h['false'] for h in healthy)}"]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one script kind per fault")
    ap.add_argument("--kinds", default=",".join(ALL))
    ap.add_argument("--faults", default=",".join(f.name for f in FAULTS))
    ap.add_argument("--no-healthy", action="store_true")
    args = ap.parse_args()
    kinds, names = args.kinds.split(","), args.faults.split(",")
    b = Bench()
    print(f"server {b.s.url}, data in {b.tmp}", flush=True)
    rows, healthy = [], []
    try:
        if not args.no_healthy:
            for k in kinds:
                h = b.healthy(k)
                healthy.append(h)
                print(f"  healthy {k}: {h}", flush=True)
        for i, f in enumerate(f for f in FAULTS if f.name in names):
            ks = [k for k in f.kinds if k in kinds]
            if args.quick and ks:
                ks = [ks[i % len(ks)]]
            for k in ks:
                r = b.run(f, k)
                rows.append(r)
                print(f"  {r}", flush=True)
    finally:
        b.close()
    print()
    print(report(rows, healthy))
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    ok = all(r.detected and r.cause and r.latency is not None and r.latency <= r.limit for r in rows)
    return 0 if ok and not any(h["false"] for h in healthy) else 1


if __name__ == "__main__":
    sys.exit(main())
