"""Slurm as the engine, against a real Slurm (tests/slurm.py: munged, slurmctld, slurmd in a
temporary directory), a real server and the real executor (`tokenpulse agent --slurm`): jobs run as
Slurm batch jobs, one node process per node under srun, reporting with the job's own credential."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import slurm
from conftest import make_server, wait_for

pytestmark = pytest.mark.skipif(slurm.installed() is not None, reason=str(slurm.installed()))

FAST = {"batch_size": 2, "grad_accum": 1, "max_seq_length": 64, "precision": "fp32", "max_retries": 0,
        "stall": {"first_step_s": 120}}


@pytest.fixture(scope="module")
def cluster():
    c = slurm.SlurmCluster().start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def srv(cluster, tmp_path_factory):
    s = make_server(tmp_path_factory.mktemp("slurm-server"))
    s.env.update({"SLURM_CONF": str(cluster.conf), "OMP_NUM_THREADS": "1"})
    s.start()
    s.executor = start_executor(s)
    yield s
    for a in s.agents:
        if a.poll() is None:
            a.send_signal(signal.SIGTERM)
    for a in s.agents:
        try:
            a.wait(20)
        except subprocess.TimeoutExpired:
            a.kill()
    s.kill()
    for q in cluster.run("squeue", "-h", "-o", "%i", check=False).split():
        cluster.run("scancel", q, check=False)


def start_executor(s) -> subprocess.Popen:
    return s.start_agent("slurm", "--slurm", "--allow-commands")


def job(c, jid: int) -> dict:
    return c.get(f"/api/jobs/{jid}").json()


def events(c, jid: int, kind: str) -> list[dict]:
    return c.get(f"/api/jobs/{jid}/events", params={"limit": 10000, "kinds": kind}).json()["events"]


def logs(c, jid: int) -> str:
    return "\n".join(e["data"]["line"] for e in events(c, jid, "log"))


def alerts(c, jid: int, kind: str) -> list[dict]:
    return [a for a in c.get("/api/alerts", params={"job_id": jid}).json() if a["kind"] == kind and a["state"] == "open"]


def slurm_info(c, jid: int) -> dict:
    return (job(c, jid).get("info") or {}).get("slurm") or {}


def ranks_of(c, jid: int) -> list[dict]:
    return c.get(f"/api/jobs/{jid}/ranks").json()


def steps(c, jid: int) -> list[int]:
    s = c.get(f"/api/jobs/{jid}/metrics", params={"keys": "loss", "max_points": 100000}).json()["series"]["loss"]
    return sorted(s["step"])


def show(srv, c, jid):
    return lambda: (job(c, jid), logs(c, jid)[-3000:], (srv.data_dir.parent / "agent-slurm.log").read_text()[-3000:])


def test_two_ranks_run_under_srun_and_report_per_rank_telemetry(srv, cluster):
    with srv.client() as c:
        jid = c.post("/api/jobs", json={**FAST, "name": "two", "max_steps": 20, "nproc_per_node": 2}).json()["id"]
        done = srv.wait_job(jid, timeout=240)
        assert done["state"] == "completed", show(srv, c, jid)()
        rows = ranks_of(c, jid)
        assert [r["rank"] for r in rows] == [0, 1], rows
        assert all(r["pid"] and r["host"] for r in rows), rows
        info = slurm_info(c, jid)
        assert info.get("job_id") and info.get("nodes") == slurm.NODE, info
        text = logs(c, jid)
        assert f"submitted as Slurm job {info['job_id']}" in text and "--cpus-per-task=2" in text, text[-2000:]
        assert f"Slurm job {info['job_id']} running on {slurm.NODE}" in text, text[-2000:]
        assert steps(c, jid) == list(range(1, 21)) or steps(c, jid)[-1] == 20
