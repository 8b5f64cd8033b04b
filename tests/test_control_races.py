"""Requests in quick succession on a real running job: a cancel wins over every later request, and
a stack request overwrites nothing."""
from __future__ import annotations

from conftest import wait_for

LONG = {"max_steps": 100000, "batch_size": 2, "grad_accum": 1, "max_seq_length": 64, "precision": "fp32"}


def running(c, jid):
    return wait_for(lambda: (lambda j: j if j["state"] == "running" and (j.get("step") or 0) >= 1 else None)(
        c.get(f"/api/jobs/{jid}").json()), 180, f"job {jid} training")


def test_cancel_then_stack_then_pause_ends_cancelled(agent_server):
    with agent_server.client() as c:
        jid = c.post("/api/jobs", json=LONG).json()["id"]
        running(c, jid)
        assert c.post(f"/api/jobs/{jid}/cancel").status_code == 200
        r = c.post(f"/api/jobs/{jid}/stack")
        assert r.status_code == 200 and r.json()["requested_action"] == "cancel", r.text
        r = c.post(f"/api/jobs/{jid}/pause")
        assert r.status_code == 409 and "cancel wins" in r.text, r.text
        job = agent_server.wait_job(jid, timeout=120)
        assert job["state"] == "cancelled", job


def test_pause_then_cancel_ends_cancelled(agent_server):
    with agent_server.client() as c:
        jid = c.post("/api/jobs", json=LONG).json()["id"]
        running(c, jid)
        assert c.post(f"/api/jobs/{jid}/pause").status_code == 200
        assert c.post(f"/api/jobs/{jid}/cancel").json()["requested_action"] == "cancel"
        job = agent_server.wait_job(jid, timeout=180)
        assert job["state"] == "cancelled", job
