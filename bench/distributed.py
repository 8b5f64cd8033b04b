"""Distributed-job benchmark on CPU (gloo), real processes: scaling of 1 vs 2 ranks, stall-to-alert
latency for a stuck rank, and the time from a rank's death to the whole gang stopped.

    python bench/distributed.py            # ~3 min on 2 busy cores
    python bench/distributed.py --quick    # fewer steps

Scaling runs the training process alone and under torchrun (no server), one compute thread per
rank, the same spec (global batch and seed): tokens/s is real tokens over all ranks (rank 0's
figure: every rank knows the whole step), per-rank efficiency = tokens/s(N) / (N x tokens/s(1)).
On a 2-core machine shared with other work, 2 ranks compete for the same cores: the number says how
much DDP costs there, not what 2 GPUs give. Latency and teardown go through a real server and agent.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from conftest import make_server, wait_for  # noqa: E402  (the tests' real-process fixtures)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
SPEC = {"batch_size": 4, "max_seq_length": 128, "tokens_per_batch": 4096, "precision": "fp32", "seed": 1}


def train(nproc: int, steps: int, work: Path) -> dict:
    spec = work / "spec.json"
    spec.write_text(json.dumps({**SPEC, "max_steps": steps, "name": f"bench-{nproc}"}))
    out = work / f"out-{nproc}"
    args = ["-m", "worker.training.train", "--spec", str(spec), "--out", str(out), "--cache-dir", str(work / "cache")]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    t0 = time.time()
    p = subprocess.run([sys.executable, "-u", *args], env=ENV, capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - t0
    if p.returncode != 0:
        raise SystemExit(f"{nproc} ranks failed:\n{p.stderr[-3000:]}")
    pts = [json.loads(x.split("metrics: ", 1)[1]) for x in p.stderr.splitlines() if "] metrics: " in x]
    tps = [m["values"]["tokens_per_s"] for m in pts if "tokens_per_s" in m["values"]]
    loss = pts[-1]["values"]["loss"]
    return {"tokens_per_s": tps[-1] if tps else float("nan"), "wall_s": wall, "loss": loss}


def server_cases(work: Path, steps: int) -> dict:
    s = make_server(work / "srv")
    s.env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    s.start()
    agent = s.start_agent("a1")
    out = {}
    base = {"max_steps": 400, "batch_size": 2, "grad_accum": 1, "max_seq_length": 64, "precision": "fp32",
            "nproc_per_node": 2, "max_retries": 0, "stall": {"floor_s": 3, "first_step_s": 60}}
    try:
        with s.client() as c:
            # a stuck rank: from its last progress to the stalled alert naming it
            jid = c.post("/api/jobs", json={**base, "name": s.plan_fault("stuck", hang_at_step=8, rank=1)}).json()["id"]
            a = wait_for(lambda: c.get("/api/alerts", params={"job_id": jid, "kind": "stalled"}).json(), 300,
                         "the stalled alert")[0]
            m = c.get(f"/api/jobs/{jid}/metrics", params={"keys": "loss"}).json()["series"]["loss"]
            timeout = float(a["message"].split("(timeout ")[1].split(" s")[0])
            out["stall_alert_s"] = a["created_at"] - max(m["t"])
            out["stall_timeout_s"] = timeout
            out["stall_message"] = a["message"]
            c.post(f"/api/jobs/{jid}/cancel")
            s.wait_job(jid, timeout=60)
            # a rank killed: from the kill to no process of the gang left
            jid = c.post("/api/jobs", json={**base, "name": "killed"}).json()["id"]
            rows = wait_for(lambda: (lambda r: r if len(r) == 2 and all(x["step"] for x in r) else None)(
                c.get(f"/api/jobs/{jid}/ranks").json()), 300, "two ranks stepping")
            import psutil
            gang = [p for p in psutil.Process(agent.pid).children(recursive=True)]
            victim = next(r["pid"] for r in rows if r["rank"] == 1)
            t0 = time.time()
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: not any(p.is_running() and p.status() != "zombie" for p in gang), 60, "the gang gone",
                     every=0.05)
            out["death_to_stopped_s"] = time.time() - t0
            job = s.wait_job(jid, timeout=60)
            out["death_reason"] = (job.get("reason") or "")[:300]
    finally:
        for a in s.agents:
            a.send_signal(signal.SIGTERM)
            a.wait(30)
        s.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    steps = 12 if args.quick else 30
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        train(1, 3, work)  # tokenize once into the cache
        one, two = train(1, steps, work), train(2, steps, work)
        cases = server_cases(work, steps)
    eff = two["tokens_per_s"] / (2 * one["tokens_per_s"])
    print("| case | value |\n|---|---|")
    print(f"| 1 rank tokens/s | {one['tokens_per_s']:,.0f} |")
    print(f"| 2 ranks tokens/s (summed) | {two['tokens_per_s']:,.0f} |")
    print(f"| per-rank efficiency (2 ranks) | {eff:.0%} |")
    print(f"| final loss 1 rank / 2 ranks | {one['loss']:.5f} / {two['loss']:.5f} |")
    print(f"| stuck rank: last progress to stalled alert | {cases['stall_alert_s']:.1f} s "
          f"(timeout {cases['stall_timeout_s']:.1f} s) |")
    print(f"| rank kill -9 to gang stopped | {cases['death_to_stopped_s']:.1f} s |")
    print(f"\nstalled alert: {cases['stall_message']}\nfailure: {cases['death_reason']}")


if __name__ == "__main__":
    main()
