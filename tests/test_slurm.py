"""Slurm as the engine, against a real Slurm (tests/slurm.py: munged, slurmctld, slurmd in a
temporary directory), a real server and the real executor (`tokenpulse agent --slurm`): jobs run as
Slurm batch jobs, one node process per node under srun, reporting with the job's own credential."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import slurm
from conftest import make_server, stop_agents, wait_for

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
    stop_agents(s)
    cluster.cancel_all()
    s.kill()


def start_executor(s) -> subprocess.Popen:
    return s.start_agent("slurm", "--slurm", "--allow-commands")


def job(c, jid: int) -> dict:
    return c.get(f"/api/jobs/{jid}").json()


def events(c, jid: int, kind: str) -> list[dict]:
    return c.get(f"/api/jobs/{jid}/events", params={"limit": 10000, "kinds": kind}).json()["events"]


def logs(c, jid: int) -> str:
    return "\n".join(e["data"]["line"] for e in events(c, jid, "log"))


def alerts(c, jid: int, kind: str) -> list[dict]:
    return c.get("/api/alerts", params={"job_id": jid, "kind": kind}).json()


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
        assert info.get("job_id") and info.get("nodes") in slurm.NODES, info
        text = logs(c, jid)
        assert f"Slurm job {info['job_id']} running on {info['nodes']}" in text, text[-2000:]
        assert "--cpus-per-task=2" in text and "--nodes=1" in text, text[-2000:]
        assert steps(c, jid) == list(range(1, 21)) or steps(c, jid)[-1] == 20


def test_a_two_node_job_runs_one_node_process_per_node(srv, cluster):
    with srv.client() as c:
        jid = c.post("/api/jobs", json={**FAST, "name": "two-nodes", "max_steps": 12, "nnodes": 2}).json()["id"]
        done = srv.wait_job(jid, timeout=240)
        assert done["state"] == "completed", show(srv, c, jid)()
        rows = ranks_of(c, jid)
        assert [r["rank"] for r in rows] == [0, 1], rows
        info = slurm_info(c, jid)
        assert info["nodes"] == "tpnode[1-2]", info
        assert "--nodes=2" in logs(c, jid)
        assert steps(c, jid)[-1] == 12


def test_a_command_job_runs_and_its_output_streams(srv, cluster):
    script = "import time\nfor i in range(16):\n    print(f'line {i}', flush=True)\n    time.sleep(0.25)\n"
    with srv.client() as c:
        r = c.post("/api/jobs/command", json={"command": [sys.executable, "-c", script], "name": "cmd"})
        assert r.status_code in (200, 201), r.text
        jid = r.json()["id"]
        # streamed while it runs, not at the end
        wait_for(lambda: "line 3" in logs(c, jid) and job(c, jid)["state"] == "running", 120,
                 "the command's output while it runs", show=show(srv, c, jid))
        done = srv.wait_job(jid, timeout=120)
        assert done["state"] == "completed", show(srv, c, jid)()
        assert "line 15" in logs(c, jid)


def test_a_job_pending_on_resources_says_so_and_pause_resume_cancel_go_through_slurm(srv, cluster):
    blocker = cluster.run("sbatch", "--parsable", f"--nodes={len(slurm.NODES)}", "--ntasks-per-node=1",
                          f"--cpus-per-task={slurm.CPUS}", "--wrap", "sleep 600", "-o", "/dev/null").strip()
    try:
        wait_for(lambda: "RUNNING" in cluster.run("squeue", "-h", "-j", blocker, "-o", "%T"), 60, "the blocker running")
        with srv.client() as c:
            jid = c.post("/api/jobs", json={**FAST, "name": "waits", "max_steps": 5}).json()["id"]

            def pending():
                j = job(c, jid)
                phase = j.get("phase") or {}
                # Slurm's reason once its scheduler looked at the job (None before)
                return j if phase.get("name") == "pending in Slurm" and phase["detail"].endswith(
                    ("Resources", "Priority")) else None
            j = wait_for(pending, 90, "the pending phase with Slurm's reason", show=show(srv, c, jid))
            assert j["state"] == "starting", j  # Slurm holds it: not running
            info = slurm_info(c, jid)
            assert info["state"] == "PENDING" and info["reason"] in ("Resources", "Priority"), info
            assert f"Slurm job {info['job_id']} pending: {info['reason']}" == j["phase"]["detail"], j["phase"]
            # pause while pending: nothing to checkpoint, Slurm lets it go; resume submits it again
            assert c.post(f"/api/jobs/{jid}/pause").status_code == 200
            assert srv.wait_job(jid, timeout=60)["state"] == "paused"
            wait_for(lambda: "CANCELLED" in cluster.run("squeue", "-h", "--states=all", "-j", info["job_id"],
                                                        "-o", "%T"), 30, "the Slurm job cancelled")
            assert c.post(f"/api/jobs/{jid}/resume").status_code == 200
            again = wait_for(lambda: slurm_info(c, jid).get("job_id") not in (None, info["job_id"]) and
                             slurm_info(c, jid), 60, "a new Slurm job", show=show(srv, c, jid))
            assert c.post(f"/api/jobs/{jid}/cancel").status_code == 200
            done = srv.wait_job(jid, ("cancelled", "failed", "completed"), timeout=60)
            assert done["state"] == "cancelled" and again["job_id"] in done["reason"], done
            wait_for(lambda: "CANCELLED" in cluster.run("squeue", "-h", "--states=all", "-j", again["job_id"],
                                                        "-o", "%T"), 30, "the Slurm job cancelled")
    finally:
        cluster.run("scancel", blocker, check=False)


def test_scancel_from_outside_is_named_with_slurms_record(srv, cluster):
    script = "import time\nwhile True:\n    print('working', flush=True)\n    time.sleep(0.5)\n"
    with srv.client() as c:
        jid = c.post("/api/jobs/command", json={"command": [sys.executable, "-c", script], "name": "outside",
                                                "max_retries": 2}).json()["id"]
        wait_for(lambda: "working" in logs(c, jid), 120, "the command running", show=show(srv, c, jid))
        sid = slurm_info(c, jid)["job_id"]
        cluster.run("scancel", sid)
        done = srv.wait_job(jid, timeout=90)
        assert done["state"] == "failed" and done["failure"] == "cancelled_outside", done
        assert f"Slurm job {sid} was cancelled outside tokenpulse" in done["reason"], done["reason"]
        assert "State=CANCELLED" in done["reason"], done["reason"]  # Slurm's record, kept
        record = slurm_info(c, jid).get("record") or {}
        assert record.get("State", "").startswith("CANCELLED"), record


def test_killing_the_executor_mid_run_loses_nothing(srv, cluster):
    name = srv.plan_fault("survives", step_sleep_s=0.2)
    with srv.client() as c:
        jid = c.post("/api/jobs", json={**FAST, "name": name, "max_steps": 50}).json()["id"]
        wait_for(lambda: (job(c, jid).get("step") or 0) >= 3, 120, "the job at step 3", show=show(srv, c, jid))
        srv.executor.kill()  # SIGKILL: no goodbye
        srv.executor.wait()
        at = job(c, jid)["step"]
        wait_for(lambda: job(c, jid)["step"] > at + 5, 60, "the job going on without its executor")
        srv.executor = start_executor(srv)
        done = srv.wait_job(jid, ("completed", "failed", "cancelled"), timeout=180)
        assert done["state"] == "completed", show(srv, c, jid)()
        assert len(job(c, jid)["attempts"]) == 1
        assert steps(c, jid) == list(range(1, 51))
        log = (srv.data_dir.parent / "agent-slurm.log").read_text()
        assert f"tokenpulse job {jid}" in log and "adopted Slurm job" in log, log[-2000:]


def test_the_job_credential_acts_for_its_job_alone_and_dies_with_its_attempt(srv, cluster):
    script = "import time\nwhile True:\n    print('working', flush=True)\n    time.sleep(0.5)\n"
    with srv.client() as c:
        jid = c.post("/api/jobs/command", json={"command": [sys.executable, "-c", script], "name": "cred"}).json()["id"]
        wait_for(lambda: "working" in logs(c, jid), 120, "the command running", show=show(srv, c, jid))
        work = srv.data_dir.parent / "work-slurm" / "slurm" / f"job-{jid}" / "attempt-1"
        token = (work / "token").read_text().strip()
        assert oct((work / "token").stat().st_mode & 0o777) == "0o600"
        assert token not in (work / "batch.sh").read_text() and srv.agent_token not in (work / "claim.json").read_text()
        aid = job(c, jid)["agent_id"]
        with srv.client(token) as node:
            assert node.get(f"/api/agents/{aid}/jobs/{jid}").json()["held"] is True
            other = node.post(f"/api/agents/{aid}/heartbeat", json={"jobs": {str(jid + 1000): time.time()}})
            assert other.status_code == 403 and f"job {jid}'s own" in other.text, other.text
            assert node.post(f"/api/agents/{aid}/claim", json={}).status_code == 403
            assert node.post("/api/agents", json={"name": "x", "host": "h"}).status_code == 403
            assert node.get("/api/jobs").status_code == 403  # no person's rights either
        # a cancel from tokenpulse: the node process stops the command, the allocation ends
        assert c.post(f"/api/jobs/{jid}/cancel").status_code == 200
        assert srv.wait_job(jid, timeout=60)["state"] == "cancelled"
        with srv.client(token) as node:
            wait_for(lambda: node.get(f"/api/agents/{aid}/jobs/{jid}").status_code == 401, 15,
                     "the credential refused once its attempt ended")


def test_slurms_endings_in_tokenpulses_words():
    from worker.agent.slurm_executor import ending
    for state, failure, retry in (("TIMEOUT", "timeout", True),
                                  ("NODE_FAIL", "node_fail", True), ("OUT_OF_MEMORY", "oom", True),
                                  ("CANCELLED by 1000", "cancelled_outside", False), ("FAILED", "lost", True)):
        v = ending({"State": state, "ExitCode": "0:15", "source": "sacct"}, "77", ours=False, cancel_asked=False)
        assert (v.state, v.failure, bool(v.retry)) == ("failed", failure, retry), (state, v)
        assert "Slurm job 77" in v.reason and f"State={state}" in v.reason, v.reason
    assert ending({"State": "CANCELLED"}, "77", ours=True, cancel_asked=False).state == "cancelled"
    v = ending({"State": "PREEMPTED"}, "77", ours=False, cancel_asked=False)  # requeued, no retry spent
    assert (v.state, v.failure) == ("queued", "preempted"), v


def test_pause_releases_the_allocation_and_resume_submits_again_from_the_checkpoint(srv, cluster):
    name = srv.plan_fault("paused", step_sleep_s=0.3)
    with srv.client() as c:
        jid = c.post("/api/jobs", json={**FAST, "name": name, "max_steps": 30}).json()["id"]
        wait_for(lambda: (job(c, jid).get("step") or 0) >= 4, 120, "the job at step 4", show=show(srv, c, jid))
        sid = slurm_info(c, jid)["job_id"]
        assert c.post(f"/api/jobs/{jid}/pause").status_code == 200
        assert srv.wait_job(jid, timeout=90)["state"] == "paused"
        wait_for(lambda: cluster.run("squeue", "-h", "--states=all", "-j", sid, "-o", "%T").strip() == "COMPLETED",
                 60, "the allocation released")
        srv.plan_fault(name)
        assert c.post(f"/api/jobs/{jid}/resume").status_code == 200
        done = srv.wait_job(jid, ("completed", "failed", "cancelled"), timeout=180)
        assert done["state"] == "completed", show(srv, c, jid)()
        assert slurm_info(c, jid)["job_id"] != sid and job(c, jid)["attempts"][-1]["resumed_from"]
        assert steps(c, jid) == list(range(1, 31))


def test_slurms_own_time_limit_warning_checkpoints_and_requeues(srv, cluster):
    """Slurm's own clock: a 2-minute limit, the warning 60 s before it (slurmctld checks limits every
    30 s or so: the warning comes 60 to 90 s into each attempt, the kill 60 s after it). The first
    attempt is slow (3 s a step, 40 steps), so it is warned mid-run; the later ones run at full speed
    with a minute each, room for a loaded machine to load the model and step (a 1-minute limit left
    them 15 s: on CI every later attempt was warned while still loading, and none stepped)."""
    name = srv.plan_fault("limited", step_sleep_s=3.0)
    spec = {**FAST, "name": name, "max_steps": 40, "slurm": {"time_limit_min": 2, "signal_before_s": 60}}
    with srv.client() as c:
        jid = c.post("/api/jobs", json=spec).json()["id"]

        def warned():
            return [a for a in job(c, jid)["attempts"] if a["outcome"] == "queued"]
        first = wait_for(warned, 180, "Slurm's warning, a checkpoint and the requeue", show=show(srv, c, jid))[0]
        assert "Slurm's warning" in first["reason"], first
        srv.plan_fault(name)  # the next attempts run at full speed
        done = srv.wait_job(jid, ("completed", "failed", "cancelled"), timeout=300)
        assert done["state"] == "completed", show(srv, c, jid)()
        assert all(a["outcome"] in ("queued", "completed") for a in done["attempts"]), done["attempts"]
        assert all(a["resumed_from"] for a in done["attempts"][1:]), done["attempts"]
        assert steps(c, jid) == list(range(1, 41))  # no step lost, none twice
        text = logs(c, jid)
        assert "--time=2" in text and "--signal=B:USR2@60" in text, text[-2000:]
        ids = {e["data"]["slurm"]["job_id"] for e in events(c, jid, "info") if "slurm" in e["data"]}
        assert len(ids) == len(done["attempts"]), ids  # a Slurm job per attempt


def test_a_rank_stuck_on_the_other_node_is_named_with_its_line(srv, cluster):
    """Two nodes: node rank 0's process asks the other node's for its ranks' stacks (through their
    rank rows on the server) and names the stuck rank across the allocation. (One node's ranks are
    grouped by the same agent code as under an agent: tests/test_distributed.py.)"""
    name = srv.plan_fault("stuck-far", hang_at_step=8, rank=1)
    with srv.client() as c:
        jid = c.post("/api/jobs", json={**FAST, "name": name, "max_steps": 400, "nnodes": 2,
                                        "stall": {"floor_s": 3, "first_step_s": 60}}).json()["id"]
        a = wait_for(lambda: alerts(c, jid, "stalled"), 180, "a stalled alert", show=show(srv, c, jid))[0]
        msg = a["message"]
        rank1 = next(r for r in ranks_of(c, jid) if r["rank"] == 1)
        assert f"rank 1 ({rank1['host']}, pid {rank1['pid']}) at _fault_hang (" in msg and "faults.py:" in msg, msg
        assert "==== rank 1 (" in a["stack"], a["stack"][:2000]
        assert c.post(f"/api/jobs/{jid}/cancel").status_code == 200
        assert srv.wait_job(jid, ("cancelled", "failed"), timeout=90)["state"] == "cancelled"
