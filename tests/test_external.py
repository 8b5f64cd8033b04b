"""The explicit API in a script started by hand (no agent): an external job on a real server,
reported by the script's own watchdog process, with stall detection naming the user's line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, wait_for

LOOP = Path(__file__).resolve().parent / "scripts" / "plain_loop.py"
BLOCK_LINE = next(i for i, line in enumerate(LOOP.read_text().splitlines(), 1) if "lock.acquire()  #" in line)


def start_loop(server, tmp_path: Path, *args: str, **env) -> subprocess.Popen:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TOKENPULSE_")}
    e.update({"TOKENPULSE_URL": server.url, "TOKENPULSE_TOKEN": server.token, "PYTHONPATH": str(ROOT),
              "PYTHONUNBUFFERED": "1", **env})
    log = (tmp_path / "loop.log").open("w")
    return subprocess.Popen([sys.executable, str(LOOP), *args], env=e, stdout=log, stderr=subprocess.STDOUT,
                            cwd=tmp_path, start_new_session=True)


def external_jobs(c: httpx.Client) -> list[dict]:
    jobs = c.get("/api/jobs").json()["jobs"]
    return [j for j in jobs if j["name"] == "plain-loop"]


def test_a_plain_loop_started_by_hand_becomes_an_external_job(server, tmp_path):
    p = start_loop(server, tmp_path, "30")
    assert p.wait(180) == 0, (tmp_path / "loop.log").read_text()
    with server.client() as c:
        [job] = external_jobs(c)
        detail = c.get(f"/api/jobs/{job['id']}").json()
        assert detail["state"] == "completed", detail
        assert detail["info"]["config"] == {"lr": 0.05, "steps": 30}
        assert detail["info"]["external"]["pid"] == p.pid
        series = c.get(f"/api/jobs/{job['id']}/metrics", params={"keys": ["loss", "lr"]}).json()["series"]
        assert series["loss"]["step"] == list(range(1, 31))
        assert series["lr"]["value"][-1] == 0.05
        phases = [e["data"] for e in c.get(f"/api/jobs/{job['id']}/events",
                                           params={"kinds": ["phase"]}).json()["events"]]
        assert {"name": "preparing data", "done": 20.0, "total": 20.0, "unit": "batches"} in phases
        # an external job has no agent to restart it: pause and resume are refused, clearly
        for refused in ("pause", "resume", "clone"):
            r = c.post(f"/api/jobs/{job['id']}/{refused}", json={})
            assert r.status_code == 409 and "external" in r.text, (refused, r.text)


def test_a_blocked_loop_raises_a_stalled_alert_naming_the_users_line(server, tmp_path):
    p = start_loop(server, tmp_path, "1000", "5", TOKENPULSE_STALL_FLOOR_S="3", TOKENPULSE_STALL_FIRST_STEP_S="120",
                   TOKENPULSE_STALL_PHASE_S="120")
    try:
        with server.client() as c:
            def stalled():
                jobs = external_jobs(c)
                if not jobs:
                    return None
                alerts = c.get("/api/alerts", params={"job_id": jobs[0]["id"]}).json()
                return next((a for a in alerts if a["kind"] == "stalled"), None)
            alert = wait_for(stalled, 120, "a stalled alert", show=lambda: (tmp_path / "loop.log").read_text()[-2000:])
            assert f"plain_loop.py:{BLOCK_LINE}" in alert["message"], alert["message"]
            assert "wait_for_the_other_rank" in alert["message"]
            assert "wait_for_the_other_rank" in alert["stack"]
            job_id = external_jobs(c)[0]["id"]
            assert c.get(f"/api/jobs/{job_id}").json()["state"] == "running"
            # a stack on request (the job page's button): the watchdog dumps it into the job's log
            assert c.post(f"/api/jobs/{job_id}/stack").status_code == 200

            def stack_logged():
                logs = c.get(f"/api/jobs/{job_id}/events", params={"kinds": ["log"]}).json()["events"]
                return any("wait_for_the_other_rank" in e["data"]["line"] for e in logs)
            wait_for(stack_logged, 60, "the requested stack in the log")
            # cancel from the server: the watchdog stops the script and the job ends cancelled
            assert c.post(f"/api/jobs/{job_id}/cancel").status_code == 200
            p.wait(60)
            job = server.wait_job(job_id, timeout=60)
            assert job["state"] == "cancelled", job
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def test_a_killed_script_is_reported_failed_by_its_watchdog(server, tmp_path):
    p = start_loop(server, tmp_path, "100000")
    with server.client() as c:
        wait_for(lambda: external_jobs(c) and external_jobs(c)[0]["state"] == "running", 120, "a running job")
        job_id = external_jobs(c)[0]["id"]
        os.kill(p.pid, signal.SIGKILL)  # no atexit, no last word: only the watchdog can tell
        p.wait(30)
        job = server.wait_job(job_id, timeout=60)
        assert job["state"] == "failed" and "without a final report" in job["reason"], job


def test_an_uncaught_exception_fails_the_job_naming_the_line(server, tmp_path):
    raise_line = next(i for i, line in enumerate(LOOP.read_text().splitlines(), 1) if "raise ValueError" in line)
    p = start_loop(server, tmp_path, "100", "-1", "7")
    assert p.wait(120) == 1
    with server.client() as c:
        [job] = external_jobs(c)
        job = server.wait_job(job["id"], timeout=60)
        assert job["state"] == "failed" and job["failure"] == "error", job
        assert job["reason"].startswith(f"plain_loop.py:{raise_line} in <module>: ValueError: loss exploded at step "
                                        "7"), job
        alerts = c.get("/api/alerts", params={"job_id": job["id"]}).json()
        assert any(a["kind"] == "crashed" and f"plain_loop.py:{raise_line}" in a["message"] for a in alerts), alerts


@pytest.mark.shared_server
def test_events_for_an_agents_job_or_another_job_are_refused(server):
    with server.client() as c:
        agent_job = c.post("/api/jobs", json={"name": "native", "max_steps": 5}).json()["id"]
        r = c.post(f"/api/jobs/{agent_job}/events", json={"events": []})
        assert r.status_code == 409
        ext = c.post("/api/jobs/external", json={"name": "by-hand", "config": {"a": 1}}).json()["id"]
        bad = {"events": [{"kind": "log", "job_id": agent_job, "seq": 0, "t": 1.0, "data": {"line": "x"}}]}
        r = c.post(f"/api/jobs/{ext}/events", json=bad)
        assert r.status_code == 422 and "job_id" in str(r.json()["detail"])
        r = c.post("/api/jobs/external", json={"name": "x" * 201})
        assert r.status_code == 422 and "name" in str(r.json()["detail"])
        ok = {"events": [{"kind": "metrics", "job_id": ext, "seq": 0, "t": 1.0,
                          "data": {"step": 1, "values": {"loss": 2.0}}}]}
        assert c.post(f"/api/jobs/{ext}/events", json=ok).json()["acked"] == {str(ext): 0}
        assert c.get(f"/api/jobs/{ext}").json()["state"] == "running"


def test_a_trainer_with_the_callback_started_by_hand_reports_as_an_external_job(server, tmp_path):
    e = {k: v for k, v in os.environ.items() if not k.startswith("TOKENPULSE_")}
    e.update({"TOKENPULSE_URL": server.url, "TOKENPULSE_TOKEN": server.token, "PYTHONPATH": str(ROOT),
              "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")})
    script = Path(__file__).resolve().parent / "scripts" / "trainer_by_hand.py"
    p = subprocess.run([sys.executable, str(script), str(ROOT / "tokenpulse" / "demo"), str(tmp_path / "out")],
                       env=e, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    with server.client() as c:
        [job] = [j for j in c.get("/api/jobs").json()["jobs"] if j["name"] == "trainer_by_hand.py"]
        assert job["state"] == "completed", job
        series = c.get(f"/api/jobs/{job['id']}/metrics",
                       params={"keys": ["loss", "tokens_per_s", "padded_tokens_per_s"]}).json()["series"]
        assert series["loss"]["step"] == [1, 2, 3, 4, 5]
        assert all(r < p for r, p in zip(series["tokens_per_s"]["value"], series["padded_tokens_per_s"]["value"]))
