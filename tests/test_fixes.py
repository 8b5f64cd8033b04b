"""From verdict to a faster run, on real processes (one server and agent for the module; the builtin
tiny model on CPU): a verdict carries its fix as a change (alerts.data["fixes"]); applying it saves a
checkpoint, stops the attempt and relaunches the job with the change at once; the new attempt is
compared with the old (GET /api/jobs/{id}/changes); revert; the CLI; the browser.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from conftest import ARTIFACTS, ROOT, make_server, wait_for

# steps slowed by a sleep (a fault), so a step's time is the sleep, whatever its tokens: what a fix
# that puts more real tokens in each step makes faster
SPEC = dict(max_steps=400, batch_size=2, grad_accum=1, precision="fp32", device="cpu", seed=3, log_every=1,
            checkpoint_every=5)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = make_server(tmp_path_factory.mktemp("fixes")).start()
    s.start_agent("a1")
    yield s
    for a in s.agents:
        a.terminate()
    for a in s.agents:
        try:
            a.wait(20)
        except subprocess.TimeoutExpired:
            a.kill()
    s.kill()


@pytest.fixture(scope="module")
def c(srv):
    with srv.client() as client:
        yield client


def job(c, jid: int) -> dict:
    r = c.get(f"/api/jobs/{jid}")
    r.raise_for_status()
    return r.json()


def alerts(c, jid: int) -> list[dict]:
    return c.get("/api/alerts", params={"job_id": jid}).json()


def with_fix(c, jid: int, kind: str):
    for a in alerts(c, jid):
        if a["state"] != "cleared" and a.get("data") and any(f["kind"] == kind for f in a["data"].get("fixes", [])):
            return a
    return None


def changes(c, jid: int) -> list[dict]:
    r = c.get(f"/api/jobs/{jid}/changes")
    r.raise_for_status()
    return r.json()


def stored_steps(srv, jid: int, metric: str = "loss") -> list[int]:
    rows = srv.query("SELECT m.step FROM metrics m JOIN metric_keys k ON k.id = m.key_id "
                     "WHERE m.job_id = ? AND k.name = ? ORDER BY m.step", (jid, metric))
    return [r[0] for r in rows]


def submit(c, srv, name: str, sleep_s: float = 0.15, **spec) -> int:
    srv.plan_fault(name, step_sleep_s=sleep_s)
    r = c.post("/api/jobs", json={**SPEC, "name": name, **spec})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def running_at(c, jid: int, step: int, timeout: float = 180) -> dict:
    return wait_for(lambda: (j := job(c, jid))["state"] == "running" and (j["step"] or 0) >= step and j,
                    timeout, f"job {jid} running past step {step}", show=lambda: job(c, jid))


def verdict(c, jid: int, timeout: float = 180) -> dict:
    def done():
        ch = [x for x in changes(c, jid) if x["state"] == "applied"]
        return ch and ch[-1]["comparison"] and ch[-1]["comparison"]["verdict"] and ch[-1]
    return wait_for(done, timeout, f"job {jid}'s before/after verdict", show=lambda: changes(c, jid))


# ---- padding -> packing and the data's length: a fresh start ------------------------------------

def test_padding_fix_relaunches_packed_and_is_verified_faster(c, srv):
    jid = submit(c, srv, "padded", padding="max_length", max_seq_length=256)
    a = wait_for(lambda: with_fix(c, jid, "padding"), 120, "the padding verdict with its fix")
    fix = a["data"]["fixes"][0]
    assert fix["changes"]["padding"] == ["max_length", "auto"]
    old, new = fix["changes"]["max_seq_length"]
    assert old == 256 and new < 256, fix
    assert fix["resume"] == "fresh" and "data position" in fix["why_fresh"]
    assert "x real tokens/s" in fix["effect"]
    running_at(c, jid, 8)
    t0 = time.time()
    r = c.post(f"/api/jobs/{jid}/fix", json={"alert_id": a["id"]})
    assert r.status_code == 200, r.text
    assert r.json()["change"]["state"] == "pending" and r.json()["job"]["requested_action"] == "pause"
    # a second fix while this one waits for its checkpoint: refused
    assert c.post(f"/api/jobs/{jid}/fix", json={"alert_id": a["id"]}).status_code == 409
    j = wait_for(lambda: (j := job(c, jid))["attempt"] == 2 and j["state"] == "running" and (j["step"] or 0) >= 1 and j,
                 120, "the relaunched attempt's first step", show=lambda: job(c, jid))
    relaunch_s = time.time() - t0
    spec = j["spec"]
    assert spec["padding"] == "auto" and spec["max_seq_length"] == new
    assert j["attempts"][0]["outcome"] == "changed", j["attempts"]
    assert j["attempts"][1]["resumed_from"] is None  # fresh: the layout changed
    v = verdict(c, jid)
    cmp = v["comparison"]
    assert v["kind"] == "padding" and v["resume"] == "fresh" and v["resume_step"] == 0
    assert cmp["before"]["tokens_per_s"] and cmp["after"]["tokens_per_s"]
    assert cmp["speedup"] > 1.5 and cmp["verdict"].startswith("verified: "), cmp
    assert "loss_equal_steps" in cmp and cmp["before"]["step_time_s"] and cmp["after"]["step_time_s"]
    steps = stored_steps(srv, jid)
    assert steps == sorted(set(steps))  # every step stored once
    print(f"FIX padding: relaunch to first step {relaunch_s:.1f} s; {cmp['verdict']}")
    c.post(f"/api/jobs/{jid}/cancel")


# ---- a crawling step -> a smaller micro-batch, more accumulation: fresh; no better -> revert ------

def test_micro_batch_fix_then_revert(c, srv):
    # every optimizer step sleeps 0.5 s whatever its micro-batches: the smaller micro-batch's pace is
    # about the old one, and the comparison says so with its number
    jid = submit(c, srv, "crawling", sleep_s=0.5, batch_size=4, grad_accum=1, max_seq_length=64, padding="dynamic",
                 stall={"slow_step_s": 0.1, "alert_open_s": 1, "floor_s": 30, "first_step_s": 60})
    a = wait_for(lambda: with_fix(c, jid, "micro_batch"), 120, "the slow verdict's micro-batch fix",
                 show=lambda: alerts(c, jid))
    fix = next(f for f in a["data"]["fixes"] if f["kind"] == "micro_batch")
    assert fix["changes"] == {"batch_size": [4, 1], "grad_accum": [1, 4]}, fix
    assert fix["resume"] == "fresh" and "same effective batch" in fix["effect"]
    running_at(c, jid, 10)
    r = c.post(f"/api/jobs/{jid}/fix", json={"kind": "micro_batch"})
    assert r.status_code == 200, r.text
    v = verdict(c, jid)
    j = job(c, jid)
    assert j["spec"]["batch_size"] == 1 and j["spec"]["grad_accum"] == 4
    cmp = v["comparison"]
    # the step is mostly its sleep: the smaller micro-batch's pace is near the old one, whichever side
    if cmp["speedup"] >= 1.1:
        assert cmp["verdict"].startswith("verified: "), cmp
    else:
        assert cmp["verdict"].startswith("no better: ") and cmp["verdict"].endswith("revert?"), cmp
    assert 0.6 < cmp["speedup"] < 1.6, cmp
    # revert: back to 4 x 1, relaunched (fresh: the checkpoint holds the 1 x 4 layout)
    r = c.post(f"/api/jobs/{jid}/fix", json={"revert": True})
    assert r.status_code == 200, r.text
    ch = r.json()["change"]
    assert ch["kind"] == "revert" and ch["changes"] == {"batch_size": [1, 4], "grad_accum": [4, 1]}
    wait_for(lambda: (j := job(c, jid))["attempt"] == 3 and j["state"] == "running" and j, 120,
             "the reverted attempt running", show=lambda: job(c, jid))
    j = job(c, jid)
    assert j["spec"]["batch_size"] == 4 and j["spec"]["grad_accum"] == 1
    hist = changes(c, jid)
    assert [x["kind"] for x in hist] == ["micro_batch", "revert"] and hist[1]["reverts"] == hist[0]["id"]
    # kept in the row when the revert was asked (the fresh revert overwrites the steps it measured)
    assert hist[0]["comparison"]["verdict"].startswith(("verified: ", "no better: "))
    assert all(x["by"] is not None and x["created_at"] for x in hist)
    # nothing left to revert
    assert c.post(f"/api/jobs/{jid}/fix", json={"revert": True}).status_code == 409
    c.post(f"/api/jobs/{jid}/cancel")
    srv.wait_job(jid, ("cancelled",))
    # a finished job takes no fix
    r = c.post(f"/api/jobs/{jid}/fix", json={"kind": "micro_batch"})
    assert r.status_code in (409, 422), r.text
