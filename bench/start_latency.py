"""Start latency of tokenpulse's own training process, on a real server and agent: from the claim (the
attempt's start) to the training process's first log line, and to its first optimizer step, for a few
tiny jobs in a row (the builtin tiny Llama, the demo data, CPU). Beside them, what a fresh Python
spends importing before it can say anything (each import line in a new process, best of 3): the most
a pre-imported parent (a zygote) could take off the first figure.

    python bench/start_latency.py [--jobs 3]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from conftest import make_server, wait_for  # noqa: E402

IMPORTS = {
    "python alone": "pass",
    "+ torch": "import torch",
    "+ transformers, datasets": "import torch, transformers, datasets",
    "+ tokenpulse's training code": "import worker.training.train, worker.training.session",
}


def import_cost(code: str) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
        best = min(best, time.perf_counter() - t)
    return best


def first(events: list[dict], test) -> float | None:
    return next((e["t"] for e in events if test(e)), None)


def one_job(c, srv, n: int) -> dict:
    jid = c.post("/api/jobs", json={"name": f"start-{n}", "max_steps": 3, "device": "cpu", "precision": "fp32",
                                   "batch_size": 2, "grad_accum": 1, "max_seq_length": 64,
                                   "test_run": False}).json()["id"]
    srv.wait_job(jid, ("completed", "failed", "cancelled"), timeout=300)
    job = c.get(f"/api/jobs/{jid}").json()
    claim = job["attempts"][-1]["started_at"]
    events = c.get(f"/api/jobs/{jid}/events", params={"limit": 100_000}).json()["events"]
    log = first(events, lambda e: e["kind"] == "log" and e["data"].get("stream") in ("stdout", "stderr"))
    step = first(events, lambda e: e["kind"] == "phase" and e["data"].get("name") == "training"
                 and (e["data"].get("done") or 0) >= 1)
    return {"state": job["state"], "log_s": log - claim if log else None, "step_s": step - claim if step else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=3)
    args = ap.parse_args(argv)
    costs = {name: import_cost(code) for name, code in IMPORTS.items()}
    with tempfile.TemporaryDirectory(prefix="tp-start-") as tmp:
        srv = make_server(Path(tmp) / "srv").start()
        try:
            srv.start_agent("start")
            with srv.client() as c:
                wait_for(lambda: c.get("/api/agents").json(), 60, "the agent registered")
                runs = [one_job(c, srv, n) for n in range(args.jobs)]
        finally:
            for a in srv.agents:
                a.terminate()
                a.wait(30)
            srv.kill()
    print(f"{'job':<5} {'state':<10} {'claim -> first log line':>24} {'claim -> first step':>20}")
    for n, r in enumerate(runs):
        print(f"{n:<5} {r['state']:<10} {r['log_s'] or float('nan'):>23.2f}s {r['step_s'] or float('nan'):>19.2f}s")
    logs = [r["log_s"] for r in runs if r["log_s"] is not None]
    steps = [r["step_s"] for r in runs if r["step_s"] is not None]
    if logs and steps:
        print(f"{'median':<16} {statistics.median(logs):>23.2f}s {statistics.median(steps):>19.2f}s  "
              f"(goal with a zygote: < 1 s to the first log line)")
    print("\nwhat a fresh Python spends before its first word (best of 3):")
    for name, s in costs.items():
        print(f"  {name:<32} {s:6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
