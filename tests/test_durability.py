"""Control and durability, on real processes (server, agents, training processes; CPU, fp32):
pause/resume continues exactly, kill -9 of the training process / the agent / the server loses
nothing, and the failure policy (oom, nan, spec, retries), priorities and per-agent limits hold.

Each scenario prints one FAULT line (fault, jobs and points before/after, what was lost) for the
closing table; run with -s to see them.
"""
from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import is_training, make_server, stop_agents, wait_for

# Tiny and fast: builtin model, fixed shapes (no autotune), fp32 on CPU, the eager loss head (no
# probe), one metric point per step.
SPEC = dict(max_steps=12, batch_size=2, grad_accum=1, max_seq_length=64, precision="fp32", torch_compile="off",
            device="cpu", seed=3, log_every=1)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """One server for the tests that need no settings of their own and check only the job they
    submitted. Its agent in service is the newest one (`live`); a test that stops it starts the next
    (`next_agent`), which the later tests take: a server start and an agent's imports (its zygote)
    are paid once for several tests instead of once each."""
    s = make_server(tmp_path_factory.mktemp("durability")).start()
    s.start_agent("a1")
    yield s
    stop_agents(s)
    s.kill()


def live(srv):
    """The module server's agent in service: the newest one started."""
    return srv.agents[-1]


def next_agent(srv, *extra: str):
    return srv.start_agent(f"a{len(srv.agents) + 1}", *extra)


def agent_name(agent) -> str:
    return agent.args[agent.args.index("--name") + 1]


def why(j: dict) -> str:
    """What a failed assertion on a job should show: its state and every attempt with its reason."""
    return f"job {j['id']} {j['state']}: {j.get('reason')!r}; attempts: " + "; ".join(
        f"#{a['attempt']} agent {a['agent_id']} {a['outcome']} {a.get('failure')} {str(a.get('reason'))[:300]!r}"
        for a in j.get("attempts", []))


def job(c: httpx.Client, jid: int) -> dict:
    r = c.get(f"/api/jobs/{jid}")
    r.raise_for_status()
    return r.json()


def stored_losses(srv, jid: int) -> dict[int, float]:
    """Every stored loss point of the job's run as its current attempt ran it (each attempt keeps its
    own points; a resume continues after the steps it resumed from), no downsampling."""
    with srv.client() as c:
        r = c.get(f"/api/jobs/{jid}/metrics", params={"keys": "loss", "max_points": 1_000_000})
    loss = r.json()["series"].get("loss", {"step": [], "value": []})
    steps = loss["step"]
    assert len(steps) == len(set(steps)), f"a step stored twice: {steps}"
    return dict(zip(steps, loss["value"]))


def point_count(srv, jid: int) -> int:
    return srv.query("SELECT count(*) FROM metrics WHERE job_id = ?", (jid,))[0][0]


def training_pids(agent) -> list[int]:
    try:
        kids = psutil.Process(agent.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p.pid for p in kids if is_training(p.cmdline())]


def step_of(path: str) -> int:
    return int(Path(path).name.removeprefix("step-"))


def assert_close(a: dict, b: dict, steps) -> None:
    for s in steps:
        assert math.isclose(a[s], b[s], rel_tol=1e-5, abs_tol=1e-6), f"step {s}: {a[s]} != {b[s]}"


def fault_line(fault: str, jobs_before, points_before, jobs_after, points_after, lost: str) -> None:
    print(f"\nFAULT | {fault} | jobs {jobs_before} -> {jobs_after} | points {points_before} -> "
          f"{points_after} | lost: {lost}")


# ---- pause / resume -----------------------------------------------------------------------------

def test_pause_then_resume_on_another_agent_continues_exactly(srv):
    a1 = live(srv)
    with srv.client() as c:
        jid = c.post("/api/jobs", json={**SPEC, "name": srv.plan_fault("paused", step_sleep_s=0.3)}).json()["id"]
        wait_for(lambda: (job(c, jid)["step"] or 0) >= 4, 90, "4 steps")
        assert c.post(f"/api/jobs/{jid}/pause").status_code == 200
        j = srv.wait_job(jid, timeout=60)
        assert j["state"] == "paused", j
        at, ckpt = j["step"], j["checkpoint"]
        assert ckpt and step_of(ckpt) == at, (at, ckpt)  # the full checkpoint is at the exact step
        assert j["attempts"][0]["outcome"] == "paused"
        points_paused = point_count(srv, jid)
        # The first agent goes away; the job resumes on another one, beside an uninterrupted twin.
        a1.send_signal(signal.SIGTERM)
        a1.wait(30)
        ref = c.post("/api/jobs", json={**SPEC, "name": "reference"}).json()["id"]
        assert c.post(f"/api/jobs/{jid}/resume").json()["state"] == "queued"
        next_agent(srv, "--capacity", "2")
        for x in (jid, ref):
            assert srv.wait_job(x, timeout=120)["state"] == "completed"
        j = job(c, jid)
    resumed, straight = stored_losses(srv, jid), stored_losses(srv, ref)
    assert sorted(resumed) == sorted(straight) == list(range(1, SPEC["max_steps"] + 1))
    assert_close(resumed, straight, range(1, SPEC["max_steps"] + 1))  # no jump at the resume
    first, second = j["attempts"]
    assert second["agent_id"] != first["agent_id"] and second["resumed_from"] == ckpt
    fault_line(f"pause at step {at}, resume on another agent", "1 paused", points_paused, "2 completed",
               point_count(srv, jid), "nothing (losses equal an uninterrupted run)")


# ---- kill -9 of the training process --------------------------------------------------------------

def test_kill9_training_process_resumes_from_newest_complete_checkpoint(srv):
    agent = live(srv)
    spec = {**SPEC, "max_steps": 14, "checkpoint_every": 4, "keep_checkpoints": 2,
            "name": srv.plan_fault("slow", step_sleep_s=0.15)}
    with srv.client() as c:
        jid = c.post("/api/jobs", json=spec).json()["id"]
        j = wait_for(lambda: (lambda x: x if (x["step"] or 0) >= 10 and x["checkpoint"] else None)(job(c, jid)),
                     90, "step 10 with a checkpoint")
        ckdir = Path(j["checkpoint"]).parent
        # A checkpoint half-written at the crash (no meta.json, no state) and a temp dir: never used.
        torn = ckdir / "step-0000099"
        (torn / "model").mkdir(parents=True)
        (ckdir / ".tmp-step-0000098-1").mkdir()
        pids = training_pids(agent)
        assert len(pids) == 1
        os.kill(pids[0], signal.SIGKILL)
        # what the first attempt stored: read once the server has its end (the agent sends the
        # events the process wrote before it died first, in order), not while they are in flight
        wait_for(lambda: (lambda a: a and a[0]["ended_at"])(job(c, jid)["attempts"]), 60, "the first attempt's end")
        before, points_before = stored_losses(srv, jid), point_count(srv, jid)
        j = srv.wait_job(jid, states=("completed", "failed"), timeout=120)
        assert j["state"] == "completed", why(j)
    after = stored_losses(srv, jid)
    first, second = j["attempts"]
    assert first["outcome"] == "retried" and first["failure"] == "signal" and first["signal"] == "SIGKILL", first
    resumed = second["resumed_from"]
    assert resumed and 4 <= step_of(resumed) <= max(before), (resumed, max(before))
    assert not torn.exists() and not (ckdir / ".tmp-step-0000098-1").exists()
    kept = sorted(p.name for p in ckdir.iterdir())
    assert len(kept) == 2 and all(n.startswith("step-") for n in kept), kept  # keep_checkpoints=2
    assert list(after) == list(range(1, 15))
    # Steps redone after the checkpoint give the very same losses: the resume is exact.
    assert_close(before, after, [s for s in before if s > step_of(resumed)])
    fault_line(f"kill -9 training process at step {max(before)}", "1 running", points_before,
               f"1 completed ({len(j['attempts'])} attempts)", point_count(srv, jid),
               f"nothing (resumed from step {step_of(resumed)}; redone steps equal)")


# ---- kill -9 of the agent -------------------------------------------------------------------------

def test_kill9_agent_lease_expires_and_another_agent_finishes(server_factory):
    srv = server_factory(agent_lost_after_s=5, reaper_every_s=0.5)
    a1 = srv.start_agent("a1")
    spec = {**SPEC, "max_steps": 14, "checkpoint_every": 4, "name": srv.plan_fault("slow", step_sleep_s=0.15)}
    with srv.client() as c:
        jid = c.post("/api/jobs", json=spec).json()["id"]
        wait_for(lambda: (lambda x: (x["step"] or 0) >= 6 and x["checkpoint"])(job(c, jid)), 90, "a checkpoint")
        pids = training_pids(a1)
        assert len(pids) == 1
        points = point_count(srv, jid)
        a1.kill()
        a1.wait()
        # The training process dies with its agent: no orphan trains on beside the next attempt.
        wait_for(lambda: not psutil.pid_exists(pids[0]) or psutil.Process(pids[0]).status() == "zombie",
                 30, "the orphaned training process to die")
        srv.start_agent("a2")
        j = srv.wait_job(jid, states=("completed", "failed"), timeout=120)
        assert j["state"] == "completed", why(j)
        alerts = c.get("/api/alerts", params={"job_id": jid}).json()
    first, second = j["attempts"]
    assert first["failure"] == "lost" and first["outcome"] == "retried", first
    assert second["agent_id"] != first["agent_id"] and second["resumed_from"], second
    assert any(a["kind"] == "worker_lost" for a in alerts), alerts
    losses = stored_losses(srv, jid)
    assert list(losses) == list(range(1, 15))
    fault_line("kill -9 agent (lease 5 s)", "1 running", points, "1 completed on another agent",
               point_count(srv, jid), f"nothing (resumed from step {step_of(second['resumed_from'])})")


# ---- an agent stopped by its operator ----------------------------------------------------------------

def test_agent_shutdown_checkpoints_and_requeues_its_job(srv):
    a1 = live(srv)
    with srv.client() as c:
        spec = {**SPEC, "max_steps": 10, "name": srv.plan_fault("slow, shut down", step_sleep_s=0.2)}
        jid = c.post("/api/jobs", json=spec).json()["id"]
        wait_for(lambda: (job(c, jid)["step"] or 0) >= 3, 90, "3 steps", show=lambda: why(job(c, jid)))
        a1.send_signal(signal.SIGTERM)  # systemd stopping the agent: not a reason to cancel anybody's job
        a1.wait(60)
        j = job(c, jid)
        assert j["state"] == "queued" and j["checkpoint"], j
        assert j["attempts"][0]["outcome"] == "queued" and "shut down" in j["attempts"][0]["reason"]
        ckpt = j["checkpoint"]
        next_agent(srv)
        j = srv.wait_job(jid, states=("completed", "failed"), timeout=120)
    assert j["state"] == "completed" and j["attempts"][1]["resumed_from"] == ckpt, why(j)
    assert len(j["attempts"]) == 2 and list(stored_losses(srv, jid)) == list(range(1, 11))


# ---- kill -9 of the server ------------------------------------------------------------------------

def test_kill9_server_mid_run_every_point_stored_exactly_once(srv):
    name = agent_name(live(srv))
    spec = {**SPEC, "max_steps": 16, "name": srv.plan_fault("slow, server killed", step_sleep_s=0.1)}
    with srv.client() as c:
        jid = c.post("/api/jobs", json=spec).json()["id"]
        wait_for(lambda: (job(c, jid)["step"] or 0) >= 4, 90, "4 steps")
    points_before = point_count(srv, jid)
    srv.kill(signal.SIGKILL)
    # training goes on while the server is down: the agent keeps what it cannot send in its journal
    held = srv.journaled(name, jid)
    wait_for(lambda: srv.journaled(name, jid) >= held + 5, 60, "events journaled while the server is down")
    srv.start()
    j = srv.wait_job(jid, states=("completed", "failed"), timeout=120)
    assert j["state"] == "completed", why(j)
    assert j["attempt"] == 1, j["attempts"]  # the run went on: never restarted
    losses = stored_losses(srv, jid)
    assert list(losses) == list(range(1, 17))
    events = srv.query("SELECT count(*) FROM events WHERE job_id = ?", (jid,))[0][0]
    next_seq = srv.query("SELECT next_seq FROM jobs WHERE id = ?", (jid,))[0][0]
    # the agent's system samples: one metrics event every 5 s, its step the Unix second
    sys_events = srv.query("SELECT count(DISTINCT m.step) FROM metrics m JOIN metric_keys k ON k.id = m.key_id "
                           "WHERE m.job_id = ? AND k.name LIKE ?", (jid, "sys/%"))[0][0]
    # Every event the agent numbered (0..next_seq-1) is stored exactly once: one metrics event per
    # step and per system sample in the metrics table, everything else in the events table.
    assert events + len(losses) + sys_events == next_seq, (events, len(losses), sys_events, next_seq)
    fault_line("kill -9 server for 3 s mid-run", "1 running", points_before, "1 completed (1 attempt)",
               point_count(srv, jid), f"nothing ({next_seq} events, each stored once)")


# ---- failure policy, priorities, limits, clone ------------------------------------------------------

class ScriptedAgent:
    """The agent protocol spoken by hand, to drive the server's policy without training anything."""

    def __init__(self, srv, capacity: int):
        self.c = httpx.Client(base_url=srv.url, timeout=30, headers={"Authorization": f"Bearer {srv.agent_token}"})
        self.id = self.c.post("/api/agents", json={"name": "scripted", "host": "h", "capacity": capacity}).json()["id"]

    def claim(self):
        r = self.c.post(f"/api/agents/{self.id}/claim")
        return r.json() if r.status_code == 200 else None

    def end(self, claim: dict, **state) -> dict:
        ev = {"kind": "state", "job_id": claim["job_id"], "seq": claim["seq_start"], "t": time.time(), "data": state}
        r = self.c.post(f"/api/agents/{self.id}/events", json={"events": [ev]})
        r.raise_for_status()
        return r.json()


def test_failure_policy_priorities_and_agent_limit(server_factory):
    srv = server_factory()
    bot = ScriptedAgent(srv, capacity=3)
    with srv.client() as c:
        def submit(**kw):
            return c.post("/api/jobs", json={**SPEC, **kw}).json()["id"]
        low = submit(name="low", priority=-5)
        oom = submit(name="oom", priority=5, batch_size=8, grad_accum=2)
        spec_bad = submit(name="spec", priority=5)
        crash = submit(name="crash", priority=1, max_retries=0)
        # Highest priority first (ties: oldest first), and never more than the agent's capacity.
        claims = [bot.claim() for _ in range(4)]
        assert [x["job_id"] for x in claims[:3]] == [oom, spec_bad, crash] and claims[3] is None
        c_oom, c_spec, c_crash = claims[:3]

        # out of memory: requeued with half the micro-batch, twice the accumulation, from step 0
        bot.end(c_oom, state="failed", failure="oom", reason="CUDA out of memory", exit_code=5, retry=True)
        j = job(c, oom)
        assert j["state"] == "queued" and (j["spec"]["batch_size"], j["spec"]["grad_accum"]) == (4, 4), j
        assert j["attempts"][0]["outcome"] == "retried" and j["attempts"][0]["failure"] == "oom"
        assert "batch_size=4, grad_accum=4" in j["reason"]
        # a bad spec: failed at once, even when the agent asks for a retry
        bot.end(c_spec, state="failed", failure="spec", reason="column 'txt' is not in the dataset", retry=True)
        j = job(c, spec_bad)
        assert j["state"] == "failed" and j["attempts"][0]["outcome"] == "failed" and len(j["attempts"]) == 1
        # a crash with no retries left: failed, and the reason says why it was not retried
        bot.end(c_crash, state="failed", failure="crash", reason="segfault", exit_code=139, retry=True)
        j = job(c, crash)
        assert j["state"] == "failed" and "max_retries=0" in j["reason"], j

        # the requeued oom job comes before the low-priority one; its retry starts from step 0
        again = bot.claim()
        assert again["job_id"] == oom and again["attempt"] == 2 and again["resume_from"] is None
        assert again["spec"]["batch_size"] == 4

        # retry / clone: a new job linked to its parent, with edits; a bad edit is a 422, not a 500
        r = c.post(f"/api/jobs/{spec_bad}/clone", json={"changes": {"max_steps": 3}})
        assert r.status_code == 201 and r.json()["parent_id"] == spec_bad and r.json()["spec"]["max_steps"] == 3
        r = c.post(f"/api/jobs/{spec_bad}/clone", json={"changes": {"max_steps": -1}})
        assert r.status_code == 422 and "max_steps" in r.text
        # pause/resume of jobs in the wrong state: refused with the reason
        r = c.post(f"/api/jobs/{low}/resume")
        assert r.status_code == 409 and "only a paused job" in r.text


def test_claim_whose_answer_was_lost_is_requeued_after_a_lease(server_factory):
    """The server committed a claim but the agent never got the answer (a connection cut mid-reply):
    the agent, alive and heartbeating, never reports the job; after a lease the policy requeues it."""
    srv = server_factory(agent_lost_after_s=2, reaper_every_s=0.5)
    bot = ScriptedAgent(srv, capacity=2)
    with srv.client() as c:
        jid = c.post("/api/jobs", json={**SPEC, "name": "orphan"}).json()["id"]
        assert bot.claim()["job_id"] == jid  # ... and the answer is "lost": the bot does not run it

        def heartbeat_without_it() -> bool:  # alive, but never reporting the job
            bot.c.post(f"/api/agents/{bot.id}/heartbeat", json={"jobs": {}}).raise_for_status()
            return job(c, jid)["state"] == "queued"
        # after the start-up grace (a lease) and then a lease without the job; generous for a busy machine
        wait_for(heartbeat_without_it, 60, "the orphaned claim requeued", every=0.5)
        j = job(c, jid)
    assert j["state"] == "queued" and j["attempts"][0]["failure"] == "lost", j
    assert "does not run this job" in j["attempts"][0]["reason"]


def test_nan_loss_stops_with_alert_naming_the_step(srv):
    with srv.client() as c:
        jid = c.post("/api/jobs",
                     json={**SPEC, "max_steps": 4, "name": srv.plan_fault("nan", nan_at_step=2)}).json()["id"]
        j = srv.wait_job(jid, states=("completed", "failed"), timeout=90)
        alerts = c.get("/api/alerts", params={"job_id": jid}).json()
    assert j["state"] == "failed" and j["failure"] == "nan" and len(j["attempts"]) == 1, j
    nan = [a for a in alerts if a["kind"] == "nan"]
    assert nan and "step 2" in nan[0]["message"] and nan[0]["state"] == "open", alerts


# ---- the agent's journal ----------------------------------------------------------------------------

def test_outbox_journal_compacts_and_survives_a_torn_line(tmp_path):
    from worker.agent.outbox import COMPACT_AFTER, Outbox
    box = Outbox(tmp_path)
    box.open_job(7, 100)
    for i in range(COMPACT_AFTER + 500):
        box.add(7, "metrics", {"step": i, "values": {"loss": 1.0}})
    box.ack({"7": 100 + COMPACT_AFTER + 99})  # all but the last 400 acknowledged: the journal shrinks
    lines = (tmp_path / "7.jsonl").read_text().splitlines()
    assert len(lines) == 400 and box.size() == 400
    box.add(7, "log", {"line": "after the rewrite"})
    with (tmp_path / "7.jsonl").open("a") as f:
        f.write('{"kind": "log", "job_id": 7, "se')  # torn by a kill -9 mid-write
    again = Outbox(tmp_path)
    again.recover()
    seqs = [e["seq"] for e in again.pending[7]]
    assert seqs == list(range(100 + COMPACT_AFTER + 100, 100 + COMPACT_AFTER + 501))
    assert again.next_seq[7] == seqs[-1] + 1
    # batches stay under the byte budget, in seq order
    batch = again.batch(max_bytes=10_000)
    assert 0 < len(batch) < len(seqs) and [e["seq"] for e in batch] == seqs[:len(batch)]
    again.ack({7: seqs[-1]})
    again.close_job(7)
    assert not (tmp_path / "7.jsonl").exists()
