"""Distributed jobs on CPU with gloo, real processes throughout: a real server, real agents, torchrun
and its ranks running the training process under DistributedDataParallel."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.conftest import wait_for

# Both the 1- and the 2-rank run take the same optimizer steps over the same real tokens (fp32, so
# no autocast rounding); what differs is the order of float sums (gradient all-reduce, split loss).
LOSS_RTOL = 2e-4
SPEC = {"max_steps": 24, "batch_size": 2, "precision": "fp32", "seed": 3, "stall": {"first_step_s": 120}}


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 2 ranks on 2 shared cores


def losses(c, job_id: int) -> list[float]:
    s = c.get(f"/api/jobs/{job_id}/metrics", params={"keys": "loss", "max_points": 100000}).json()["series"]["loss"]
    return [v for _, v in sorted(zip(s["step"], s["value"]))]


def ranks_of(c, job_id: int) -> list[dict]:
    r = c.get(f"/api/jobs/{job_id}/ranks")
    assert r.status_code == 200, r.text
    return r.json()


def test_two_ranks_match_one_rank_and_show_a_rank_table(server):
    server.start_agent("a1")
    with server.client() as c:
        one = c.post("/api/jobs", json={**SPEC, "name": "one"}).json()["id"]
        two = c.post("/api/jobs", json={**SPEC, "name": "two", "nproc_per_node": 2}).json()["id"]
        assert server.wait_job(one, timeout=240)["state"] == "completed"

        def both_ranks_stepping():
            rows = ranks_of(c, two)
            return rows if len(rows) == 2 and all(r["step"] and r["pid"] and r["host"] for r in rows) else None
        rows = wait_for(both_ranks_stepping, 240, "two ranks in the rank table, both stepping",
                        show=lambda: ranks_of(c, two))
        assert [r["rank"] for r in rows] == [0, 1]
        assert rows[0]["pid"] != rows[1]["pid"] and all(r["device"] == "cpu" for r in rows)
        assert all(r["rss_mb"] > 10 and r["step_time_s"] is not None and r["progress_age_s"] is not None for r in rows)
        job = server.wait_job(two, timeout=240)
        assert job["state"] == "completed", job
        a, b = losses(c, one), losses(c, two)
        assert len(a) == len(b) == SPEC["max_steps"]
        for step, (x, y) in enumerate(zip(a, b), 1):
            assert abs(x - y) <= LOSS_RTOL * abs(x), f"step {step}: 1 rank {x}, 2 ranks {y}"
        # only rank 0 saved: one final model; the job's log is rank 0's account
        events = c.get(f"/api/jobs/{two}/events", params={"limit": 10000}).json()["events"]
        infos = [e["data"] for e in events if e["kind"] == "info" and "world_size" in e["data"]]
        assert sorted(d["rank"] for d in infos) == [0, 1] and {d["world_size"] for d in infos} == {2}
        finals = [e for e in events if e["kind"] == "checkpoint" and e["data"].get("final")]
        assert len(finals) == 1
        assert ranks_of(c, one) == []
        assert c.get("/api/jobs/999999/ranks").status_code == 404


def test_spec_bounds_process_counts(server):
    with server.client() as c:
        r = c.post("/api/jobs", json={"nproc_per_node": 0})
        assert r.status_code == 422 and "nproc_per_node" in r.text
        r = c.post("/api/jobs", json={"nnodes": 1000})
        assert r.status_code == 422 and "nnodes" in r.text
