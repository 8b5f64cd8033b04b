"""Distributed jobs under control and loss, real processes throughout: pause and resume of a 2-rank
job, a lost member agent failing its whole gang, and the rank table's exit column after the end."""
from __future__ import annotations

import signal

import pytest
from conftest import wait_for
from test_cli import cli, ok
from test_distributed import FAST, _alive, _children, alerts, job_step, losses, ranks_of


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # ranks on 2 shared cores


def test_a_paused_two_rank_job_resumes_and_every_step_is_stored_once(server):
    server.start_agent("a1")
    with server.client() as c:
        name = server.plan_fault("paused-gang", step_sleep_s=0.2)
        jid = c.post("/api/jobs", json={**FAST, "max_steps": 30, "name": name, "max_retries": 0}).json()["id"]
        wait_for(lambda: job_step(c, jid) >= 6, 180, "the job at step 6")
        r = c.post(f"/api/jobs/{jid}/pause")
        assert r.status_code == 200, r.text
        j = server.wait_job(jid, timeout=120)
        assert j["state"] == "paused", (j["reason"], j["attempts"])
        at, ckpt = j["step"], j["checkpoint"]
        assert ckpt and ckpt.endswith(f"step-{at:07d}"), (at, ckpt)
        assert 6 <= at < 30
        rows = ranks_of(c, jid)  # the exit column, filled when the attempt ended: REST and CLI
        assert [(x["rank"], x["exit"]) for x in rows] == [(0, "paused"), (1, "paused")], rows
        out = ok(cli(server, "ranks", str(jid)))
        assert "exit" in out and out.count("paused") >= 2, out
        assert c.post(f"/api/jobs/{jid}/resume").json()["state"] == "queued"
        j = server.wait_job(jid, states=("completed", "failed", "cancelled"), timeout=240)
        assert j["state"] == "completed", (j["reason"], j["attempts"])
        first, second = j["attempts"]
        assert first["outcome"] == "paused" and second["resumed_from"] == ckpt
        loss = c.get(f"/api/jobs/{jid}/metrics", params={"keys": "loss", "max_points": 100000}).json()["series"]["loss"]
        assert sorted(loss["step"]) == list(range(1, 31))  # every step stored once, none twice
        series = losses(c, jid)
        # continuous: the step after the resume is no jump from the one before it
        jumps = [abs(b - a) for a, b in zip(series, series[1:])]
        typical = sorted(jumps)[len(jumps) // 2]
        assert abs(series[at] - series[at - 1]) <= max(4 * typical, 0.5), (at, series[at - 3:at + 3])
        rows = ranks_of(c, jid)
        assert [x["rank"] for x in rows] == [0, 1] and all(x["exit"] == "completed" for x in rows), rows


@pytest.mark.parametrize("victim, sig", [("lead", signal.SIGSTOP), ("member", signal.SIGKILL)])
def test_a_lost_member_agent_fails_the_whole_gang_and_the_job_completes_on_a_new_one(server_factory, victim, sig):
    # SIGSTOP of node rank 0's agent (its machine hangs): the lease lapses, the job is retried as a
    # whole, and node rank 1's agent, which reports no job of its own, is told to stop its ranks.
    # SIGKILL of node rank 1's agent: its ranks die with it, and node rank 0's must not wait on them.
    # Then a new gang (the survivor and a third agent) resumes from the checkpoint.
    srv = server_factory(gang_timeout_s=120, agent_lost_after_s=6, reaper_every_s=0.5)
    agents = {n: srv.start_agent(n, "--address", "127.0.0.1") for n in ("g1", "g2")}
    with srv.client() as c:
        spec = {**FAST, "nproc_per_node": 1, "nnodes": 2, "max_steps": 40, "checkpoint_every": 5,
                "max_retries": 1, "keep_checkpoints": 100,
                # slow steps in the first attempt: it cannot finish on its own before the gang is stopped
                # (about 10 s after the loss: a lease of 6 s, then the survivor's next heartbeat)
                "name": srv.plan_fault("lost-gang", step_sleep_s=1.0)}
        jid = c.post("/api/jobs", json=spec).json()["id"]
        wait_for(lambda: c.get(f"/api/jobs/{jid}").json().get("checkpoint") and job_step(c, jid) >= 7, 240,
                 "a checkpoint and step 7", show=lambda: c.get(f"/api/jobs/{jid}").json()["reason"])
        rows = ranks_of(c, jid)
        names = {a["id"]: a["name"] for a in c.get("/api/agents").json()}
        by_role = {"lead": names[rows[0]["agent_id"]], "member": names[rows[1]["agent_id"]]}
        assert by_role["lead"] != by_role["member"]
        lost, kept = by_role[victim], by_role["member" if victim == "lead" else "lead"]
        survivors = _children(agents[kept].pid)
        assert survivors, "torchrun and its rank under the surviving agent"
        agents[lost].send_signal(sig)
        try:
            job = wait_for(lambda: (lambda j: j if j["attempts"][0]["outcome"] == "retried" else None)(
                c.get(f"/api/jobs/{jid}").json()), 60, "the attempt failed as a whole")
            first = job["attempts"][0]
            if victim == "lead":  # only the lease tells: the job's reporter went silent
                assert first["failure"] == "lost" and "worker lost" in first["reason"], first
            # the survivor's share is stopped: its torchrun and rank exit (with 30+ steps of 1 s left)
            wait_for(lambda: not any(_alive(p) for p in survivors), 30, "the surviving agent's processes stopped")
            wait_for(lambda: c.get("/api/agents").json() and all(
                a["state"] == "lost" for a in c.get("/api/agents").json() if a["name"] == lost), 60, "the agent lost")
            rows = {r["rank"]: r for r in ranks_of(c, jid)}
            if victim == "lead":
                assert rows[0]["exit"] == "lost with its agent" and rows[1]["exit"] == "stopped by gang", rows
                out = ok(cli(srv, "ranks", str(jid)))
                assert "lost with its agent" in out and "stopped by gang" in out, out
            else:  # node rank 0's agent saw its rank fail on the dead peer; rank 1 it could not see
                assert rows[0]["exit"] and rows[0]["exit"] != "completed", rows
                assert rows[1]["exit"] in ("stopped by gang", "lost with its agent"), rows
            srv.plan_fault("lost-gang", step_sleep_s=0.05)  # read at the next attempt's start
            srv.start_agent("g3", "--address", "127.0.0.1")  # the new gang: the survivor and g3
            job = srv.wait_job(jid, states=("completed", "failed", "cancelled"), timeout=300)
            assert job["state"] == "completed", (job["reason"], job["attempts"])
            second = job["attempts"][1]
            assert second["resumed_from"] and "step-" in second["resumed_from"], second
            events = c.get(f"/api/jobs/{jid}/events", params={"limit": 10000}).json()["events"]
            said = [e["data"]["line"] for e in events
                    if e["kind"] == "log" and "attempt 2: " in e["data"].get("line", "")]
            assert any(f"resuming from {second['resumed_from']}" in x for x in said), said
            assert names.get(second["agent_id"]) != lost
            loss = c.get(f"/api/jobs/{jid}/metrics",
                         params={"keys": "loss", "max_points": 100000}).json()["series"]["loss"]
            assert sorted(loss["step"]) == list(range(1, spec["max_steps"] + 1))  # every step stored once
            assert {r["exit"] for r in ranks_of(c, jid)} == {"completed"}
        finally:
            agents[lost].kill()  # SIGKILL reaches a stopped process; its ranks die with it
            agents[lost].wait(30)


def test_a_stuck_rank_on_another_node_is_named_in_one_verdict_across_the_gang(server_factory):
    # 2 agents x 1 rank: rank 1 (node rank 1's agent) hangs; node rank 0's agent sees only rank 0 in
    # all_reduce, the other agent only rank 1: the alert must merge both into one verdict.
    srv = server_factory(gang_timeout_s=120)
    for n in ("n1", "n2"):
        srv.start_agent(n, "--address", "127.0.0.1")
    with srv.client() as c:
        name = srv.plan_fault("stuck-gang", hang_at_step=8, rank=1)
        jid = c.post("/api/jobs", json={**FAST, "nproc_per_node": 1, "nnodes": 2, "name": name,
                                        "max_retries": 0}).json()["id"]
        wait_for(lambda: job_step(c, jid) >= 8, 240, "the job at step 8")
        a = wait_for(lambda: alerts(c, jid, "stalled"), 120, "a stalled alert")[0]
        msg = a["message"]
        rows = {r["rank"]: r for r in ranks_of(c, jid)}
        assert rows[0]["agent_id"] != rows[1]["agent_id"]
        # the odd rank first, with its host, pid and blocking line; then rank 0 in its collective
        assert f"rank 1 ({rows[1]['host']}, pid {rows[1]['pid']}) at _fault_hang (" in msg, msg
        assert "faults.py:" in msg, msg
        assert f"rank 0 ({rows[0]['host']}, pid {rows[0]['pid']}) waiting in all_reduce at " in msg, msg
        assert "distributed.py" in msg or "loop.py" in msg, msg
        assert "==== rank 0 (" in a["stack"] and "==== rank 1 (" in a["stack"], a["stack"][:2000]
        # a person's stack request: the same merged verdict, in the job's log

        def merged_line():
            events = c.get(f"/api/jobs/{jid}/events", params={"limit": 10000}).json()["events"]
            return [e["data"]["line"] for e in events if e["kind"] == "log" and e["data"].get("stream") == "agent"
                    and e["data"]["line"].startswith("rank 1 (")]
        assert c.post(f"/api/jobs/{jid}/stack").status_code in (200, 202)
        line = wait_for(merged_line, 60, "the merged verdict in the job's log")[0]
        assert "at _fault_hang (" in line and "waiting in all_reduce at " in line and "==== rank 1 (" in line, line
        c.post(f"/api/jobs/{jid}/cancel")
        assert srv.wait_job(jid, timeout=90)["state"] in ("cancelled", "failed")
