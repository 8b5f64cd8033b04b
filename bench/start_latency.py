"""Start latency of tokenpulse's own training process, on a real server and agent: from the claim (the
attempt's start) to the training process's first log line, and to its first optimizer step, for a few
tiny jobs in a row (the builtin tiny Llama, the demo data, CPU), side by side: an agent started with
--no-warm-start (each job a new process) and agents keeping a zygote (worker/agent/warm.py: each
job's process forked from one that has its imports done): `warm`, each job claimed once the zygote is
idle (an agent waiting for work, a fix's relaunch after a long attempt), and `warm-b2b`, the jobs back
to back (goal < 1 s to the first log line). Beside them, what a fresh Python spends importing before
it can say anything (each import line in a new process, best of 3): what the zygote takes off.

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


def zygote_idle(agent_pid: int) -> bool:
    """The agent's zygote waits for requests (its imports done)."""
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and b"worker.training.zygote" in (d / "cmdline").read_bytes() and \
                    (d / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(agent_pid) and \
                    "poll" in (d / "wchan").read_text():
                return True
        except OSError:
            continue
    return False


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
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tp-start-") as tmp:
        srv = make_server(Path(tmp) / "srv").start()
        try:
            with srv.client() as c:
                for how, extra in (("plain", ("--no-warm-start",)), ("warm", ()), ("warm-b2b", ())):
                    agent = srv.start_agent(how, *extra, env={"TOKENPULSE_WARM_START": "1"})
                    wait_for(lambda: any(a["name"] == how and a["state"] == "online"
                                         for a in c.get("/api/agents").json()), 60, "the agent registered")
                    runs[how] = []
                    for n in range(args.jobs):
                        if how == "warm" or (how == "warm-b2b" and n == 0):
                            wait_for(lambda: zygote_idle(agent.pid), 120, "the warm agent's zygote idle")
                        runs[how].append(one_job(c, srv, n))
                    agent.terminate()
                    agent.wait(60)
        finally:
            for a in srv.agents:
                if a.poll() is None:
                    a.terminate()
                    a.wait(30)
            srv.kill()
    print(f"{'agent':<8} {'job':<4} {'state':<10} {'claim -> first log line':>24} {'claim -> first step':>20}")
    for how, rs in runs.items():
        for n, r in enumerate(rs):
            print(f"{how:<8} {n:<4} {r['state']:<10} {r['log_s'] or float('nan'):>23.2f}s "
                  f"{r['step_s'] or float('nan'):>19.2f}s")
    med = {}
    for how, rs in runs.items():
        logs = [r["log_s"] for r in rs if r["log_s"] is not None]
        steps = [r["step_s"] for r in rs if r["step_s"] is not None]
        if logs and steps:
            med[how] = (statistics.median(logs), statistics.median(steps))
            print(f"{how + ' median':<22} {med[how][0]:>23.2f}s {med[how][1]:>19.2f}s")
    for how in ("warm", "warm-b2b"):
        if how in med and "plain" in med:
            print(f"{how + ' / plain':<24} {med[how][0] / med['plain'][0]:>21.2f}x "
                  f"{med[how][1] / med['plain'][1]:>19.2f}x")
    print("\nwhat a fresh Python spends before its first word (best of 3):")
    for name, s in costs.items():
        print(f"  {name:<32} {s:6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
