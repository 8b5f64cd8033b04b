"""Detection benchmark on real processes: time from fault to alert for each case against the
configured timeout (goal: within timeout + 2 s), and false alerts over a long healthy run and a
long slow-phase run (goal: zero).

    python bench/detection.py            # full (~5 min on 2 busy cores)
    python bench/detection.py --quick    # shorter runs

One server (agent_lost_after_s=5, a webhook receiver on 127.0.0.1 that answers 500 first), one agent
with one compute thread per training process; jobs use the tight per-job thresholds of the tests
(spec.stall.floor_s=3), which makes false alerts more likely, not less.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from conftest import is_training, make_server  # noqa: E402  (the tests' real-process fixtures)

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
BASE = {"batch_size": 2, "grad_accum": 1, "max_seq_length": 64, "precision": "fp32", "max_retries": 0,
        "stall": {"floor_s": 3, "first_step_s": 30}}
LOST_AFTER = 5.0


class Receiver:
    def __init__(self):
        self.hits: list[tuple[float, int, dict]] = []
        me = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                first = not any(b.get("id") == body.get("id") and b.get("state") == body.get("state")
                                for _, _, b in me.hits)
                code = 500 if first else 200
                me.hits.append((time.time(), code, body))
                self.send_response(code)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def wait_for(fn, timeout, every=0.2):
    end = time.time() + timeout
    while time.time() < end:
        v = fn()
        if v:
            return v
        time.sleep(every)
    return None


class Bench:
    def __init__(self, quick: bool):
        self.quick = quick
        self.tmp = Path(tempfile.mkdtemp(prefix="tp-bench-detect-"))
        self.rx = Receiver()
        self.s = make_server(self.tmp, agent_lost_after_s=LOST_AFTER, reaper_every_s=0.5,
                             webhooks=[self.rx.url], webhook_retries=3)
        self.s.start()
        self.agent = self.s.start_agent("a1", env=ONE_THREAD)
        self.c = self.s.client()
        self.rows: list[dict] = []

    def submit(self, fault=None, **spec) -> int:
        if fault:  # test-only faults travel in the agent's TOKENPULSE_FAULT_PLAN file, keyed by job name
            spec["name"] = self.s.plan_fault(f"fault-{len(self.rows)}-{time.monotonic_ns()}", **fault)
        r = self.c.post("/api/jobs", json={**BASE, **spec})
        r.raise_for_status()
        return r.json()["id"]

    def alerts(self, jid, kind=None) -> list[dict]:
        p = {"job_id": jid, **({"kind": kind} if kind else {})}
        return self.c.get("/api/alerts", params=p).json()

    def job(self, jid) -> dict:
        return self.c.get(f"/api/jobs/{jid}").json()

    def wait_state(self, jid, states=("completed", "failed", "cancelled"), timeout=600) -> dict:
        return wait_for(lambda: (lambda j: j if j["state"] in states else None)(self.job(jid)),
                        timeout) or self.job(jid)

    def wait_step(self, jid, step, timeout=300):
        return wait_for(lambda: (self.job(jid).get("step") or 0) >= step, timeout)

    def step_times(self, jid) -> dict[int, float]:
        m = self.c.get(f"/api/jobs/{jid}/metrics", params={"keys": ["loss"], "max_points": 100000}).json()
        m = m["series"].get("loss", {})
        return dict(zip(m.get("step", []), m.get("t", [])))

    def row(self, case, delay, limit, note="", ok=None):
        ok = (delay is not None and delay <= limit + 2) if ok is None else ok
        self.rows.append({"case": case, "delay": delay, "limit": limit, "ok": ok, "note": note})
        print(f"  {case}: {'-' if delay is None else f'{delay:.2f} s'} (limit {limit}) {note}", flush=True)

    def training_pid(self) -> int:
        for _ in range(50):
            for p in psutil.Process(self.agent.pid).children(recursive=True):
                if is_training(p.cmdline()):
                    return p.pid
            time.sleep(0.1)
        raise RuntimeError("no training process")

    # ---- cases ---------------------------------------------------------------------------------

    def hang(self, tool_note=""):
        jid = self.submit(max_steps=400, fault={"hang_at_step": 10})
        a = wait_for(lambda: self.alerts(jid, "stalled"), 180)
        if not a:
            return self.row("hang -> stalled", None, "?", "no alert", ok=False)
        a = a[0]
        t_hang = self.step_times(jid)[10]
        timeout = float(re.search(r"\(timeout (\d+(?:\.\d+)?) s", a["message"]).group(1))
        stack_ok = "_fault_hang" in (a.get("stack") or "")
        self.row("hang_at_step -> stalled (stack shows _fault_hang)", a["created_at"] - t_hang, timeout,
                 f"stack ok={stack_ok}; {a['message'].split('; stuck at ')[-1]}", ok=None if stack_ok else False)
        self.c.post(f"/api/jobs/{jid}/cancel")
        self.wait_state(jid, timeout=60)
        self.hang_alert = a

    def kill_training(self):
        jid = self.submit(max_steps=2000)
        self.wait_step(jid, 5)
        pid = self.training_pid()
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        j = self.wait_state(jid, timeout=60)
        ok = j["state"] == "failed" and j.get("signal") == "SIGKILL"
        self.row("kill -9 training process -> failed (SIGKILL named)", (j.get("finished_at") or time.time()) - t0,
                 0, f"state={j['state']} signal={j.get('signal')}", ok=ok and (j.get("finished_at") or 1e18) - t0 <= 2)

    def slow_throughput(self):
        jid = self.submit(max_steps=70 if self.quick else 120, fault={"slow_after_step": 40, "slow_factor": 5})
        a = wait_for(lambda: self.alerts(jid, "slow"), 300)
        self.wait_state(jid)
        if not a:
            return self.row("throughput falls 5x -> slow", None, "?", "no alert", ok=False)
        steps = self.step_times(jid)
        t0 = steps[40]  # the last fast step; the first slow step ends at 41
        slow_step = (steps[max(steps)] - steps[41]) / max(1, max(steps) - 41)
        limit = round(3 * slow_step, 1)  # the evidence: 3 slow samples (the median of the last 5)
        self.row("throughput falls 5x -> slow", a[0]["created_at"] - t0, limit,
                 f"(limit = 3 slow steps of {slow_step:.2f} s) {a[0]['message'][:90]}")
        self.slow_jid = jid

    def padding(self):
        jid = self.submit(max_steps=12, padding="max_length", max_seq_length=1024)
        a = wait_for(lambda: self.alerts(jid, "slow"), 300)
        self.wait_state(jid)
        if not a:
            return self.row("padding=max_length far above data -> slow", None, "?", "no alert", ok=False)
        steps = self.step_times(jid)
        # speed figures start after 2 warm-up steps; 3 samples are the evidence
        t_ready, per = steps.get(5), (steps[max(steps)] - steps[1]) / max(1, max(steps) - 1)
        rec = re.search(r"max_seq_length=(\d+) \(the recommended", a[0]["message"])
        self.row("padding=max_length far above data -> slow/padding", a[0]["created_at"] - t_ready, 0,
                 f"names waste & length={rec.group(1) if rec else None}; step {per:.2f} s",
                 ok=bool(rec) and a[0]["created_at"] - t_ready <= 2)

    def webhook(self):
        a = getattr(self, "hang_alert", None)
        if a is None:
            return
        hits = [(t, code) for t, code, b in self.rx.hits if b.get("id") == a["id"] and b.get("state") == "open"]
        delivered = [t for t, code in hits if code == 200]
        codes = [code for _, code in hits]
        self.row("webhook (first answer 500) -> delivered once",
                 (delivered[0] - a["created_at"]) if delivered else None,
                 0, f"answers={codes}",
                 ok=codes == [500, 200] and bool(delivered) and delivered[0] - a["created_at"] <= 2)

    def kill_agent(self):
        jid = self.submit(max_steps=2000, max_retries=1)
        self.wait_step(jid, 3)
        orphans = [p.pid for p in psutil.Process(self.agent.pid).children(recursive=True)]
        t0 = time.time()
        self.agent.send_signal(signal.SIGKILL)
        a = wait_for(lambda: self.alerts(jid, "worker_lost"), 60, every=0.1)
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        j = self.job(jid)
        self.row("kill -9 agent -> lost, job requeued by policy", (a[0]["created_at"] - t0) if a else None,
                 LOST_AFTER, f"job {j['state']} ({j.get('failure')})", ok=bool(a) and j["state"] == "queued"
                 and a[0]["created_at"] - t0 <= LOST_AFTER + 2)
        self.c.post(f"/api/jobs/{jid}/cancel")

    def false_alerts(self):
        n = 300 if self.quick else 1000
        t0 = time.time()
        jid = self.submit(max_steps=n)
        j = self.wait_state(jid, timeout=900)
        bad = [a for a in self.alerts(jid) if a["kind"] in ("stalled", "slow")]
        busy = len(self.alerts(jid, "contention"))
        self.rows.append({"case": f"healthy run, {n} steps ({time.time() - t0:.0f} s)", "false": len(bad), "busy": busy,
                          "ok": not bad and j["state"] == "completed",
                          "note": "; ".join(a["message"][:80] for a in bad)})
        print(f"  healthy: {len(bad)} false alerts, {j['state']}", flush=True)
        # the demo job as users submit it (autotuned batch, packing, auto precision), tight thresholds:
        # also exercises the preflight-projection rule against the autotune measurement
        t0 = time.time()
        r = self.c.post("/api/jobs", json={"name": "demo", "max_steps": 150 if self.quick else 400,
                                            "stall": {"floor_s": 3}})
        r.raise_for_status()
        jid = r.json()["id"]
        j = self.wait_state(jid, timeout=900)
        bad = [a for a in self.alerts(jid) if a["kind"] in ("stalled", "slow")]
        busy = len(self.alerts(jid, "contention"))
        self.rows.append({"case": f"demo job as submitted, {j.get('step')} steps ({time.time() - t0:.0f} s)",
                          "false": len(bad), "busy": busy, "ok": not bad and j["state"] == "completed",
                          "note": "; ".join(a["message"][:80] for a in bad)})
        print(f"  demo: {len(bad)} false alerts, {j['state']}", flush=True)
        secs = 30 if self.quick else 90
        jid = self.submit(max_steps=5, fault={"slow_data_s": secs})
        j = self.wait_state(jid, timeout=900)
        bad = [a for a in self.alerts(jid) if a["kind"] in ("stalled", "slow")]
        busy = len(self.alerts(jid, "contention"))
        self.rows.append({"case": f"slow data phase {secs} s (= {secs // 3}x the 3 s timeout)", "false": len(bad),
                          "busy": busy,
                          "ok": not bad and j["state"] == "completed",
                          "note": "; ".join(a["message"][:80] for a in bad)})
        print(f"  slow phase: {len(bad)} false alerts, {j['state']}", flush=True)

    def close(self):
        self.c.close()
        for a in self.s.agents:
            if a.poll() is None:
                a.send_signal(signal.SIGTERM)
                try:
                    a.wait(20)
                except Exception:
                    a.kill()
        self.s.kill()
        self.rx.httpd.shutdown()


def table(rows: list[dict]) -> str:
    out = ["| case | fault -> alert | configured timeout | within timeout + 2 s | note |",
           "|---|---|---|---|---|"]
    for r in rows:
        if "false" in r:
            continue
        d = "-" if r["delay"] is None else f"{r['delay']:.2f} s"
        lim = "none: at once" if r["limit"] == 0 else f"{r['limit']} s"
        out.append(f"| {r['case']} | {d} | {lim} | {'yes' if r['ok'] else 'NO'} | {r['note']} |")
    out += ["", "| run | false alerts (stalled/slow) | busy-machine notices (info 'contention') | ok | note |",
            "|---|---|---|---|---|"]
    for r in rows:
        if "false" in r:
            out.append(f"| {r['case']} | {r['false']} | {r.get('busy', 0)} | {'yes' if r['ok'] else 'NO'} | "
                       f"{r['note']} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    b = Bench(args.quick)
    print(f"server {b.s.url}, data in {b.tmp}", flush=True)
    try:
        b.hang()
        b.webhook()
        b.kill_training()
        b.slow_throughput()
        b.padding()
        b.false_alerts()
        b.kill_agent()
    finally:
        b.close()
    print()
    print(table(b.rows))
    print(f"\nload average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0 if all(r["ok"] for r in b.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
