"""The spine, end to end through real parts: uvicorn on a free port, real agent processes training
a real tiny model, a real websocket client."""
from __future__ import annotations

import json
import math
import time

import pytest
from conftest import wait_for


def read_frames(ws, job_id: int, until_state=("completed", "failed", "cancelled"), timeout: float = 300):
    """Collect websocket frames for a job until it reaches a final state."""
    frames = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            raw = ws.recv(timeout=max(0.1, deadline - time.time()))
        except TimeoutError:
            break
        f = json.loads(raw)
        frames.append(f)
        if f["type"] == "job" and f["job"]["id"] == job_id and f["job"]["state"] in until_state:
            return frames
    raise AssertionError(f"job {job_id} did not finish in {timeout} s; last frames: {frames[-5:]}")


def test_demo_job_streams_phase_heartbeat_metrics_state_and_matches_storage(agent_server):
    s = agent_server
    with s.ws("jobs,job:1") as ws, s.client() as c:
        # the demo job (its builtin model and data), 40 of its 200 steps: the stream is the same
        r = c.post("/api/jobs", json={"name": "demo", "max_steps": 40})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        assert job_id == 1
        frames = read_frames(ws, job_id)

    kinds_in_order = []
    streamed: dict[tuple[str, int], float] = {}
    for f in frames:
        if f["type"] == "heartbeat":
            kinds_in_order.append("heartbeat")
        elif f["type"] == "events":
            for e in f["events"]:
                system = e["kind"] == "metrics" and all(k.startswith("sys/") for k in e["data"]["values"])
                # the agent's system samples (sys/) run from the process's start, the training
                # process's own metrics come after its phases
                kinds_in_order.append("sys" if system else e["kind"])
                if e["kind"] == "metrics":
                    for k, v in e["data"]["values"].items():
                        streamed[(k, e["data"]["step"])] = v
        elif f["type"] == "job":
            kinds_in_order.append("state:" + f["job"]["state"])

    # phase frames come first, then metrics; heartbeats arrive while it runs; state last
    first_phase = kinds_in_order.index("phase")
    first_metrics = kinds_in_order.index("metrics")
    assert first_phase < first_metrics
    assert "heartbeat" in kinds_in_order
    assert kinds_in_order[-1] == "state:completed"
    states = [k for k in kinds_in_order if k.startswith("state:")]
    assert states.index("state:running") < states.index("state:completed")

    with s.client() as c:
        job = c.get(f"/api/jobs/{job_id}").json()
        assert job["state"] == "completed", job
        assert job["output_dir"], "final model directory is recorded"
        stored = c.get(f"/api/jobs/{job_id}/metrics", params={"max_points": 1_000_000}).json()["series"]
        events = c.get(f"/api/jobs/{job_id}/events", params={"kinds": ["phase"]}).json()["events"]

    losses = stored["loss"]["value"]
    assert len(losses) >= 10 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], "the tiny model learns something"
    # every streamed number is stored, exactly as streamed
    for (key, step), value in streamed.items():
        i = stored[key]["step"].index(step)
        assert stored[key]["value"][i] == pytest.approx(value, rel=1e-12)
    assert sum(len(v["step"]) for v in stored.values()) == len(streamed)
    phase_names = [e["data"]["name"] for e in events]
    for name in ("loading model", "tokenizing", "training", "saving"):
        assert name in phase_names, phase_names
    tok = [e["data"] for e in events if e["data"]["name"] == "tokenizing"]
    assert tok[-1]["done"] == tok[-1]["total"] and tok[-1]["unit"] == "examples"

    # the saved model loads with from_pretrained
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(job["output_dir"])
    tokenizer = AutoTokenizer.from_pretrained(job["output_dir"])
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_cancel_running_job_stops_training_process(agent_server):
    s = agent_server
    with s.client() as c:
        job = c.post("/api/jobs", json={"name": s.plan_fault("slow", step_sleep_s=0.05),
                                         "max_steps": 10000}).json()
        s.wait_job(job["id"], states=("running",), timeout=60)
        # wait until it is training, so the cancel hits a live training loop
        wait_for(lambda: (c.get(f"/api/jobs/{job['id']}").json().get("phase") or {}).get("name") == "training",
                 120, "the training phase")
        r = c.post(f"/api/jobs/{job['id']}/cancel")
        assert r.status_code == 200 and r.json()["requested_action"] == "cancel"
        done = s.wait_job(job["id"], timeout=60)
        assert done["state"] == "cancelled", done
        assert done["step"] < 10000
        # cancelling again is a clear conflict, not a silent success
        r = c.post(f"/api/jobs/{job['id']}/cancel")
        assert r.status_code == 409 and "cancelled" in r.json()["detail"]
        # the agent is free again: the next job runs
        nxt = c.post("/api/jobs", json={"name": "after", "max_steps": 5}).json()
        assert s.wait_job(nxt["id"], timeout=90)["state"] == "completed"


def test_cancel_queued_job_is_immediate(server):
    with server.client() as c:
        job = c.post("/api/jobs", json={"name": "never runs"}).json()
        r = c.post(f"/api/jobs/{job['id']}/cancel")
        assert r.status_code == 200 and r.json()["state"] == "cancelled"


def test_two_agents_five_jobs_each_runs_exactly_once(server):
    server.start_agent("a1")
    server.start_agent("a2")
    with server.client() as c:
        # both registered before the queue fills: on a busy machine one could otherwise run them all
        wait_for(lambda: sum(a["state"] == "online" for a in c.get("/api/agents").json()) == 2, 120,
                 "both agents online")
        ids = [c.post("/api/jobs", json={"name": f"j{i}", "max_steps": 8}).json()["id"] for i in range(5)]
        jobs = [server.wait_job(i, timeout=300) for i in ids]
        assert [j["state"] for j in jobs] == ["completed"] * 5
        for j in jobs:
            assert len(j["attempts"]) == 1 and j["attempt"] == 1, j["attempts"]
        agents_used = {j["attempts"][0]["agent_id"] for j in jobs}
        assert len(agents_used) == 2, "both agents took work"
        for i in ids:
            starts = c.get(f"/api/jobs/{i}/events", params={"kinds": ["log"]}).json()["events"]
            assert sum("attempt 1" in e["data"]["line"] for e in starts if e["data"]["stream"] == "agent") == 1
