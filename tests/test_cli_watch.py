"""`tokenpulse watch`: a steady ETA, and Ctrl+C stops watching, never the job."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

from conftest import ROOT, wait_exit, wait_for

from tokenpulse.progress import RateEstimator, format_duration


def test_eta_is_steady_when_step_times_jump():
    # a loaded machine: steps alternate 0.14 s and 1.8 s (mean 0.97 s); 2,000 steps in all
    est, t, etas = RateEstimator(), 0.0, []
    for step in range(1, 200):
        t += 0.14 if step % 2 else 1.8
        est.update("training", t, step)
        if step > 60:
            etas.append(est.eta_s(step, 2000) / (2000 - step))  # seconds per remaining step
    assert max(etas) / min(etas) < 1.3, (min(etas), max(etas))  # a raw last-step ETA swings 13x
    assert 0.75 < sum(etas) / len(etas) < 1.25


def test_eta_restarts_with_a_new_phase_or_a_counter_going_back():
    est = RateEstimator()
    for i in range(10):
        est.update("tokenizing", float(i), i * 1000)
    assert est.eta_s(9000, 10000) is not None
    est.update("training", 10.0, 0)
    assert est.eta_s(0, 100) is None  # no rate for the new phase yet
    est.update("training", 11.0, 5)
    est.update("training", 12.0, 2)  # resumed from an older checkpoint
    assert est.eta_s(2, 100) is None
    assert format_duration(59.4) == "59s" and format_duration(83) == "1m 23s" and format_duration(7260) == "2h 01m"


def test_watch_shows_eta_and_ctrl_c_leaves_the_job_running(agent_server):
    with agent_server.client() as c:
        jid = c.post("/api/jobs", json={"max_steps": 100000, "batch_size": 2, "grad_accum": 1,
                                        "max_seq_length": 64, "precision": "fp32"}).json()["id"]
        env = {**agent_server.env, "TOKENPULSE_URL": agent_server.url, "TOKENPULSE_TOKEN": agent_server.token,
               "FORCE_COLOR": "1", "COLUMNS": "200"}
        p = subprocess.Popen([sys.executable, "-m", "tokenpulse.cli", "watch", str(jid)], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out: list[str] = []
        threading.Thread(target=lambda: out.extend(iter(p.stdout.readline, "")), daemon=True).start()
        wait_for(lambda: any("ETA " in x and any(ch.isdigit() for ch in x.split("ETA ")[1][:3]) for x in out),
                 180, "an ETA in the watch output", show=lambda: "".join(out)[-2000:])
        p.send_signal(signal.SIGINT)
        assert wait_exit(p, 60, "`tokenpulse watch` after Ctrl+C") == 130
        text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", "".join(out))  # colours off
        assert "keeps running" in text and f"tokenpulse cancel {jid}" in text, text[-400:]
        assert c.get(f"/api/jobs/{jid}").json()["state"] == "running"
        assert c.post(f"/api/jobs/{jid}/cancel").status_code == 200
