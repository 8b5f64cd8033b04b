"""Distributed jobs on CPU with gloo, real processes throughout: a real server, real agents, torchrun
and its ranks running the training process under DistributedDataParallel."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from conftest import wait_for
from test_cli import cli, ok

# Both the 1- and the 2-rank run take the same optimizer steps over the same real tokens (fp32, so
# no autocast rounding); what differs is the order of float sums (gradient all-reduce, split loss).
# torch_compile off here and in FAST: no test of this file is about the loss-head choice, and its
# check (rank 0 timing forward+backward before the first step) costs each launch about a CPU-second.
LOSS_RTOL = 2e-4
SPEC = {"max_steps": 12, "batch_size": 2, "precision": "fp32", "seed": 3, "torch_compile": "off",
        "stall": {"first_step_s": 120}}


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


def series(c, job_id: int, key: str) -> list[float]:
    s = c.get(f"/api/jobs/{job_id}/metrics", params={"keys": key, "max_points": 100000}).json()["series"][key]
    return [v for _, v in sorted(zip(s["step"], s["value"]))]


def eval_batches(c, job_id: int) -> set[int]:
    """The batch counts of the job's evaluating phases (rank 0's account)."""
    events = c.get(f"/api/jobs/{job_id}/events", params={"limit": 10000, "kind": "phase"}).json()["events"]
    return {e["data"]["total"] for e in events if e["data"].get("name") == "evaluating" and e["data"].get("total")}


def test_two_ranks_match_one_rank_and_show_a_rank_table(server):
    server.start_agent("a1")
    evals = {"eval_fraction": 0.1, "eval_every": 6}
    with server.client() as c:
        one = c.post("/api/jobs", json={**SPEC, **evals, "name": "one"}).json()["id"]
        two = c.post("/api/jobs", json={**SPEC, **evals, "name": "two", "nproc_per_node": 2}).json()["id"]
        assert server.wait_job(one, timeout=240)["state"] == "completed"

        def both_ranks_stepping():
            rows = ranks_of(c, two)
            return rows if len(rows) == 2 and all(r["step"] and r["pid"] and r["host"] for r in rows) else None
        rows = wait_for(both_ranks_stepping, 240, "two ranks in the rank table, both stepping",
                        show=lambda: ranks_of(c, two))
        assert [r["rank"] for r in rows] == [0, 1]
        assert rows[0]["pid"] != rows[1]["pid"] and all(r["device"] == "cpu" for r in rows)
        assert all(r["rss_mb"] > 10 and r["step_time_s"] is not None and r["progress_age_s"] is not None for r in rows)
        out = ok(cli(server, "ranks", str(two)))  # the same table from the CLI
        assert "2 ranks" in out and all(str(r["pid"]) in out for r in rows), out
        job = server.wait_job(two, timeout=240)
        assert job["state"] == "completed", job
        a, b = losses(c, one), losses(c, two)
        assert len(a) == len(b) == SPEC["max_steps"]
        for step, (x, y) in enumerate(zip(a, b), 1):
            assert abs(x - y) <= LOSS_RTOL * abs(x), f"step {step}: 1 rank {x}, 2 ranks {y}"
        # the evaluation is sharded over the ranks (each evaluates half the batches) with the same result
        ea, eb = series(c, one, "eval/loss"), series(c, two, "eval/loss")
        assert len(ea) == len(eb) == 2, (ea, eb)
        assert all(abs(x - y) <= LOSS_RTOL * abs(x) for x, y in zip(ea, eb)), (ea, eb)
        (n1,), (n2,) = eval_batches(c, one), eval_batches(c, two)
        assert n2 == (n1 + 1) // 2, (n1, n2)
        # only rank 0 saved: one final model; the job's log is rank 0's account
        events = c.get(f"/api/jobs/{two}/events", params={"limit": 10000}).json()["events"]
        infos = [e["data"] for e in events if e["kind"] == "info" and "world_size" in e["data"]]
        assert sorted(d["rank"] for d in infos) == [0, 1] and {d["world_size"] for d in infos} == {2}
        finals = [e for e in events if e["kind"] == "checkpoint" and e["data"].get("final")]
        assert len(finals) == 1
        assert ranks_of(c, one) == []
        assert c.get("/api/jobs/999999/ranks").status_code == 404


@pytest.mark.shared_server
def test_spec_bounds_process_counts(server):
    with server.client() as c:
        r = c.post("/api/jobs", json={"nproc_per_node": 0})
        assert r.status_code == 422 and "nproc_per_node" in r.text
        r = c.post("/api/jobs", json={"nnodes": 1000})
        assert r.status_code == 422 and "nnodes" in r.text


def alerts(c, job_id: int, kind: str) -> list[dict]:
    return c.get("/api/alerts", params={"job_id": job_id, "kind": kind}).json()


def job_step(c, job_id: int) -> int:
    return c.get(f"/api/jobs/{job_id}").json().get("step") or 0


FAST = {"max_steps": 400, "batch_size": 2, "grad_accum": 1, "max_seq_length": 64, "precision": "fp32",
        "torch_compile": "off", "nproc_per_node": 2, "stall": {"floor_s": 3, "first_step_s": 60}}


def test_a_stuck_rank_is_named_with_its_line_and_the_others_collective(server):
    server.start_agent("a1")
    with server.client() as c:
        name = server.plan_fault("stuck", hang_at_step=8, rank=1)
        jid = c.post("/api/jobs", json={**FAST, "name": name, "max_retries": 0}).json()["id"]
        wait_for(lambda: job_step(c, jid) >= 8, 180, "the job at step 8")
        a = wait_for(lambda: alerts(c, jid, "stalled"), 90, "a stalled alert")[0]
        msg = a["message"]
        rank1 = next(r for r in ranks_of(c, jid) if r["rank"] == 1)
        # the odd one out first, with its host, pid and the blocking line; then rank 0's collective
        assert f"rank 1 ({rank1['host']}, pid {rank1['pid']}) at _fault_hang (" in msg, msg
        assert "faults.py:" in msg, msg
        assert "ranks 0 waiting in all_reduce" in msg or "rank 0 (" in msg and "waiting in all_reduce" in msg, msg
        assert "distributed.py" in msg or "loop.py" in msg, msg
        assert "==== rank 0 (" in a["stack"] and "==== rank 1 (" in a["stack"], a["stack"][:2000]
        assert a["created_at"] - time.time() < 5  # open now, while it hangs
        c.post(f"/api/jobs/{jid}/cancel")
        assert server.wait_job(jid, timeout=60)["state"] in ("cancelled", "failed")


def test_kill_9_of_one_rank_stops_the_gang_and_the_job_resumes_from_its_checkpoint(server):
    agent = server.start_agent("a1")
    with server.client() as c:
        spec = {**FAST, "max_steps": 40, "checkpoint_every": 10, "max_retries": 1, "name": "killed"}
        jid = c.post("/api/jobs", json=spec).json()["id"]
        wait_for(lambda: c.get(f"/api/jobs/{jid}").json().get("checkpoint") and job_step(c, jid) >= 14, 180,
                 "a checkpoint and step 14")
        rows = ranks_of(c, jid)
        victim = next(r for r in rows if r["rank"] == 1)
        others = [r["pid"] for r in rows if r["rank"] != 1]
        launcher = [p for p in _children(agent.pid) if _is_torchrun(p)]
        assert launcher, "torchrun under the agent"
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: not any(_alive(p) for p in others + launcher), 10, "the gang stopped within 10 s")
        stopped_in = time.time() - killed_at
        job = server.wait_job(jid, timeout=240)
        assert job["state"] == "completed", job
        attempts = c.get(f"/api/jobs/{jid}").json()["attempts"]
        first = attempts[0]
        assert first["outcome"] == "retried" and first["signal"] == "SIGKILL", first
        assert f"rank 1 ({victim['host']}, pid {victim['pid']})" in first["reason"], first["reason"]
        assert attempts[1]["resumed_from"] and "step-" in attempts[1]["resumed_from"]
        loss = c.get(f"/api/jobs/{jid}/metrics", params={"keys": "loss", "max_points": 100000}).json()["series"]["loss"]
        assert sorted(loss["step"]) == list(range(1, 41))  # every step stored once
        assert stopped_in < 10


def _children(pid: int) -> list[int]:
    import psutil
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def _is_torchrun(pid: int) -> bool:
    try:
        return "torch.distributed.run" in open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


# A user's own torch.distributed script (not tokenpulse's worker), reporting over the job's event
# pipe the way tokenpulse's instrumentation does: each rank reopens the pipe its launcher inherited.
DDP_SCRIPT = '''
import json, os, socket, sys, time
import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
pipe = os.open(f"/proc/{os.getppid()}/fd/{os.environ['TOKENPULSE_EVENT_FD']}", os.O_WRONLY)


def emit(kind, **data):
    os.write(pipe, (json.dumps({"kind": kind, "t": time.time(), "rank": rank, "data": data}) + "\\n").encode())


def wait_for_shard():
    while True:
        time.sleep(1)


dist.init_process_group("gloo")
steps = int(os.environ.get("STEPS", "400"))
for step in range(steps):
    if rank == int(os.environ.get("HANG_RANK", "-1")) and step == int(os.environ.get("HANG_STEP", "-1")):
        wait_for_shard()
    t = torch.ones(1000)
    dist.all_reduce(t)
    time.sleep(0.05)
    emit("phase", name="training", done=step + 1, total=steps, unit="steps")
    emit("alive", step=step + 1)
'''


def stuck_rank_of_a_command_job(server_factory, tmp_path, body: dict, stuck: int):
    """DDP_SCRIPT as a command job whose rank `stuck` blocks: the rank table and the verdict naming
    that rank's line and the other's collective. Returns the server (the job cancelled)."""
    roots = tmp_path / "roots"
    (roots / "proj").mkdir(parents=True)
    (roots / "proj" / "ddp.py").write_text(DDP_SCRIPT)
    srv = server_factory(path_roots=[str(roots)])
    srv.start_agent("cmd", "--allow-commands")
    with srv.client() as c:
        r = c.post("/api/jobs/command", json={**body, "cwd": str(roots / "proj"), "max_retries": 0,
                                              "env": {"HANG_RANK": str(stuck), "HANG_STEP": "8"},
                                              "stall": {"floor_s": 3, "first_step_s": 60}})
        assert r.status_code == 201, r.text
        jid = r.json()["id"]
        a = wait_for(lambda: alerts(c, jid, "stalled"), 180, "a stalled alert")[0]
        rows = ranks_of(c, jid)
        assert [x["rank"] for x in rows] == [0, 1] and all(x["pid"] and x["host"] for x in rows), rows
        msg, me = a["message"], rows[stuck]
        assert f"rank {stuck} ({me['host']}, pid {me['pid']}) at wait_for_shard (" in msg and "ddp.py:" in msg, msg
        assert "waiting in all_reduce at <module> (" in msg, msg
        c.post(f"/api/jobs/{jid}/cancel")
        assert srv.wait_job(jid, timeout=60)["state"] == "cancelled"
    return srv


def test_a_torchrun_command_job_gets_the_rank_table_and_the_stuck_rank_named(server_factory, tmp_path):
    srv = stuck_rank_of_a_command_job(server_factory, tmp_path,
                                      {"command": [sys.executable, "ddp.py"], "nproc_per_node": 2}, stuck=1)
    with srv.client() as c:
        r = c.post("/api/jobs/command", json={"command": ["true"], "nnodes": 2})
        assert r.status_code == 422 and "nnodes" in r.text


def test_an_accelerate_launch_command_job_gets_the_rank_table_and_the_stuck_rank_named(server_factory, tmp_path):
    # `accelerate launch` runs torch's elastic launcher in its own process: its children are the
    # ranks, as under torchrun (--multi_gpu only picks that launcher; the script uses gloo on CPU)
    argv = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "ddp.py"]
    stuck_rank_of_a_command_job(server_factory, tmp_path, {"command": argv}, stuck=0)


def test_two_agents_form_one_gang_and_a_third_takes_no_half_of_it(server_factory):
    srv = server_factory(gang_timeout_s=60)
    for name in ("g1", "g2", "g3"):
        srv.start_agent(name, "--address", "127.0.0.1")
    with srv.client() as c:
        jid = c.post("/api/jobs", json={**SPEC, "name": "gang", "nnodes": 2}).json()["id"]
        rows = wait_for(lambda: (lambda r: r if len(r) == 2 and all(x["step"] for x in r) else None)(ranks_of(c, jid)),
                        240, "ranks 0 and 1 stepping, one per agent",
                        show=lambda: (ranks_of(c, jid), c.get(f"/api/jobs/{jid}").json()["reason"]))
        assert rows[0]["agent_id"] != rows[1]["agent_id"], rows
        agents = {a["id"]: a for a in c.get("/api/agents").json()}
        gang = {rows[0]["agent_id"], rows[1]["agent_id"]}
        third = next(a for a in agents.values() if a["id"] not in gang)
        assert third["jobs"] == []  # the full gang took no third agent
        job = srv.wait_job(jid, timeout=240)
        assert job["state"] == "completed", (job["reason"], job["attempts"])
        assert job["agent_id"] is None and len(job["attempts"]) == 1 and job["attempts"][0]["agent_id"] in gang
        loss = c.get(f"/api/jobs/{jid}/metrics", params={"keys": "loss", "max_points": 100000}).json()["series"]["loss"]
        assert sorted(loss["step"]) == list(range(1, SPEC["max_steps"] + 1))


def test_a_gang_that_cannot_gather_lets_its_agent_go(server_factory):
    srv = server_factory(gang_timeout_s=3)
    srv.start_agent("alone", "--address", "127.0.0.1")
    with srv.client() as c:
        big = c.post("/api/jobs", json={**SPEC, "name": "big", "nnodes": 2, "priority": 10}).json()["id"]
        small = c.post("/api/jobs", json={**SPEC, "name": "small", "max_steps": 3}).json()["id"]
        # the lone agent joins the gang, is released after the timeout and runs the job it can run
        assert srv.wait_job(small, timeout=240)["state"] == "completed"
        job = c.get(f"/api/jobs/{big}").json()
        assert job["state"] == "queued" and "did not gather within 3 s" in (job["reason"] or ""), job


def test_a_straggling_rank_is_a_straggler_alert_naming_rank_and_host(server):
    server.start_agent("a1")
    with server.client() as c:
        name = server.plan_fault("straggler", step_sleep_s=0.6, rank=1)  # rank 1 works 0.6 s more a step
        jid = c.post("/api/jobs", json={**FAST, "name": name, "max_retries": 0}).json()["id"]
        a = wait_for(lambda: alerts(c, jid, "straggler"), 240, "a straggler alert")[0]
        rank1 = next(r for r in ranks_of(c, jid) if r["rank"] == 1)
        assert a["message"].startswith(f"straggler: rank 1 ({rank1['host']}, pid {rank1['pid']}) works "), a["message"]
        rows = wait_for(lambda: (lambda r: r if all(x["busy_s"] is not None for x in r) else None)(ranks_of(c, jid)),
                        30, "both ranks' own work per step in the rank table")
        assert rows[1]["busy_s"] > 0.5 > rows[0]["busy_s"], rows
        c.post(f"/api/jobs/{jid}/cancel")
        assert server.wait_job(jid, timeout=60)["state"] == "cancelled"
