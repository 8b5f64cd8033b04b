"""A full disk, made real: a small tmpfs (tests/smallfs.py) under the agent's work dir or the
server's data dir, filled to the last byte, then freed. Named, alerted, never wedged, recovered."""
from __future__ import annotations

import json
import subprocess
import time

import httpx
import pytest
from conftest import make_server, wait_for
from smallfs import fill, small_fs

from tests import pg

pytestmark = pytest.mark.skipif(pg.enabled(), reason="SQLite only: the SQLite file on a full disk")

# torch_compile off: a 5000-step run would otherwise compile the loss head (~10 CPU-s) in each test
LONG = {"max_steps": 5000, "batch_size": 2, "grad_accum": 1, "max_seq_length": 64, "precision": "fp32",
        "torch_compile": "off", "max_retries": 0}
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def paced(srv) -> dict:
    """LONG, its steps 0.1 s apart: it trains on while a test waits for a full disk's effects, and
    at full speed that costs a core for as long as the wait lasts."""
    return {**LONG, "name": srv.plan_fault("paced", step_sleep_s=0.1)}


def job(c, jid: int) -> dict:
    return c.get(f"/api/jobs/{jid}").json()


def alerts(c, jid: int, kind: str) -> list[dict]:
    return c.get("/api/alerts", params={"job_id": jid, "kind": kind}).json()


def three_heartbeats(c) -> None:
    """Three more heartbeats from the live agent (each a second), seen by the server."""
    beats = set()
    wait_for(lambda: beats.add(c.get("/api/agents").json()[0]["seen_at"]) or len(beats) > 3, 60,
             "three heartbeats with the disk full")


def test_agent_disk_full_is_alerted_never_wedges_and_recovers(server):
    with small_fs(server.data_dir.parent / "work-a1", "16m") as work:
        agent = server.start_agent("a1", env=ONE_THREAD)
        with server.client() as c:
            jid = c.post("/api/jobs", json=paced(server)).json()["id"]
            wait_for(lambda: (job(c, jid).get("step") or 0) >= 3, 120, "training steps")
            filler = fill(work)
            a = wait_for(lambda: alerts(c, jid, "disk_full"), 60, "a disk_full alert")[0]
            assert a["severity"] == "critical" and "no space left on the device of" in a["message"], a
            step = job(c, jid)["step"]
            wait_for(lambda: job(c, jid)["step"] >= step + 3, 60, "training to go on, its events still sent")
            assert c.post(f"/api/jobs/{jid}/cancel").status_code == 200
            ended = server.wait_job(jid, timeout=60)  # before: the job stayed running; cancel did nothing
            assert ended["state"] == "cancelled", ended
            log = (server.data_dir.parent / "agent-a1.log").read_text()
            assert "journal: no space left on the device of" in log
            assert agent.poll() is None
            filler.unlink()  # space returns: the next job is claimed and runs
            jid2 = c.post("/api/jobs", json={**LONG, "max_steps": 4}).json()["id"]
            done = server.wait_job(jid2, timeout=120)
            assert done["state"] == "completed", done
            assert not [a for a in alerts(c, jid, "disk_full") if a["state"] == "open"]
        assert not list((work / "journal").glob("*.jsonl")) or all(
            all(json.loads(x) for x in p.read_text().splitlines()) for p in (work / "journal").glob("*.jsonl"))



def test_server_disk_full_answers_507_naming_it_and_recovers_losing_nothing(tmp_path):
    from test_detection import Receiver
    rx = Receiver(fail_first=0)
    s = make_server(tmp_path, webhooks=[rx.url])
    with small_fs(s.data_dir, "24m") as data:
        try:
            s.start()
            s.start_agent("a1", env=ONE_THREAD)
            with s.client() as c:
                # at full speed: the events must outgrow the WAL's pages for the 507 to come
                jid = c.post("/api/jobs", json=LONG).json()["id"]
                wait_for(lambda: (job(c, jid).get("step") or 0) >= 3, 120, "training steps")
                filler = fill(data)
                agent_log = s.data_dir.parent / "agent-a1.log"
                # SQLite rewrites its WAL in place while it can: writes fail once it must grow
                wait_for(lambda: "answered 507" in agent_log.read_text(), 90, "the agent's events to be refused 507")
                with httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {s.agent_token}"}) as ac:
                    # a heartbeat's two-row update may still fit in the WAL's pages (then it is stored);
                    # when it does not, it is a 507 naming the disk, never a bare 500
                    hb = ac.post("/api/agents/1/heartbeat", json={"jobs": {str(jid): time.time()}})
                    assert hb.status_code == 200 or (hb.status_code == 507 and "disk is full" in hb.text), \
                        (hb.status_code, hb.text)
                # the same for a person's write: a job that still fits in the WAL is stored (and
                # cancelled below), the first one that does not is a 507 naming the file
                extra: list[int] = []

                def submit_refused():
                    resp = c.post("/api/jobs", json=LONG)
                    if resp.status_code == 201:
                        extra.append(resp.json()["id"])
                        return None
                    return resp
                r = wait_for(submit_refused, 90, "a job submission refused")
                assert r.status_code == 507 and "disk is full" in r.json()["detail"], (r.status_code, r.text)
                assert "tokenpulse.db" in r.json()["detail"] and int(r.headers["retry-after"]) > 0
                step_when_full = job(c, jid)["step"]
                hook = wait_for(lambda: [b for _, b in rx.bodies if b["kind"] == "disk_full"], 30, "a webhook")
                assert hook[0]["state"] == "open" and "disk is full" in hook[0]["text"], hook  # it cannot store it

                filler.unlink()  # space returns: the agent's journaled events all arrive, none twice
                for x in extra:  # queued behind jid: never claimed
                    assert wait_for(lambda: c.post(f"/api/jobs/{x}/cancel").status_code == 200, 30, "a cancel")
                wait_for(lambda: job(c, jid)["step"] >= step_when_full + 5, 120, "progress stored again")
                assert c.post(f"/api/jobs/{jid}/cancel").status_code == 200
                ended = s.wait_job(jid, timeout=60)
                assert ended["state"] == "cancelled" and ended["attempt"] == 1, ended  # never lost, never retried
                steps = c.get(f"/api/jobs/{jid}/metrics",
                              params={"keys": ["loss"], "max_points": 100000}).json()["series"]["loss"]["step"]
                assert steps == list(range(steps[0], steps[0] + len(steps))), "a gap in the stored loss series"
                assert c.get("/api/agents").json()[0]["state"] == "online"
                wait_for(lambda: [b for _, b in rx.bodies if b["kind"] == "disk_full" and b["state"] == "cleared"],
                         30, "the webhook saying it is over")
        finally:
            rx.close()
            for a in s.agents:
                a.terminate()
                try:
                    a.wait(30)
                except subprocess.TimeoutExpired:  # still draining into a full disk: the failure above counts
                    a.kill()
            s.kill()


def test_disk_full_while_saving_a_checkpoint_is_named_alerted_final_and_keeps_what_is_stored(server):
    from worker.checkpoint_layout import checkpoint_step, list_checkpoints, step_from_name
    # job 1's output dir (checkpoints) on its own small disk; the agent's journal and cache elsewhere
    with small_fs(server.data_dir.parent / "work-a1" / "jobs" / "1" / "out", "64m") as out:
        server.start_agent("a1", env=ONE_THREAD)
        with server.client() as c:
            jid = c.post("/api/jobs", json={**paced(server), "checkpoint_every": 3, "max_retries": 2}).json()["id"]
            assert jid == 1
            first = wait_for(lambda: job(c, jid).get("checkpoint"), 120, "a first checkpoint")
            filler = fill(out)
            ended = server.wait_job(jid, timeout=120)
            assert ended["state"] == "failed" and ended["failure"] == "disk_full", ended
            assert "no space left on the disk of" in ended["reason"], ended["reason"]
            assert "while saving a checkpoint at step" in ended["reason"], ended["reason"]
            assert "mounted at " + str(out) in ended["reason"], ended["reason"]
            assert ended["attempt"] == 1 and len(ended["attempts"]) == 1, ended  # not retried
            a = alerts(c, jid, "disk_full")
            assert a and a[0]["severity"] == "critical" and "while saving a checkpoint" in a[0]["message"]
            assert not alerts(c, jid, "crashed")
            # what was stored stays: complete checkpoints (the first among them or a newer one), no torn one
            kept = list_checkpoints(out)
            assert kept and all(checkpoint_step(p) is not None for p in kept), kept
            assert f"the newest complete checkpoint is kept: {kept[-1]}" in ended["reason"]
            # (the first may itself have been pruned by keep_checkpoints before the disk filled)
            assert checkpoint_step(kept[-1]) >= step_from_name(__import__("pathlib").Path(first))
            assert not [p for p in (out / "checkpoints").iterdir() if p not in kept]
            filler.unlink()


def test_an_agent_whose_disk_is_full_leaves_a_training_job_queued_and_claims_it_once_freed(server):
    """(A claim made just before the disk fills is requeued, no retry spent, when its spec cannot be
    written: Agent.start_job.)"""
    with small_fs(server.data_dir.parent / "work-a1", "16m") as work:
        agent = server.start_agent("a1", env=ONE_THREAD)
        with server.client() as c:
            wait_for(lambda: c.get("/api/agents").json(), 60, "the agent to register")
            filler = fill(work)
            jid = c.post("/api/jobs", json={**LONG, "max_steps": 4}).json()["id"]
            log = server.data_dir.parent / "agent-a1.log"
            wait_for(lambda: "no claims until space returns" in log.read_text(), 60, "the agent to say why")
            # a claim asked for before the disk filled may be answered after: it is handed back. Three
            # more heartbeats from the live agent (a hand-back is sent at once, before them), then the
            # job is queued (a job that ran instead would go on to running and never be queued again)
            three_heartbeats(c)
            j = wait_for(lambda: (lambda j: j if j["state"] == "queued" else None)(job(c, jid)), 60,
                         "the job handed back to the queue", show=lambda: job(c, jid))
            # Claimed before the agent's watch saw the disk fill, a job is handed back: requeued, its
            # attempt naming the full disk, no retry spent (the job completes on attempt 1's budget).
            handed_back = j["attempts"]
            assert all("no space left on the device of" in a["reason"] and a["reason"].endswith("requeued")
                       for a in handed_back), handed_back
            filler.unlink()
            done = server.wait_job(jid, timeout=120)
            assert done["state"] == "completed", done
            assert len(done["attempts"]) == len(handed_back) + 1, done["attempts"]
            assert agent.poll() is None


def test_an_agent_whose_disk_is_full_claims_nothing_until_space_returns(server, tmp_path):
    """Issue 25, item 24: the disk_full alert says the agent claims no new job until space returns;
    it claimed and ran them (a command job with a cwd of its own writes nothing to the work dir
    before it runs). Now an idle agent whose work dir is full leaves the queue alone, says why, and
    claims the job once space returns."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "ran.py").write_text("import pathlib; pathlib.Path('ran').write_text('yes')\n")
    with small_fs(server.data_dir.parent / "work-a1", "16m") as work:
        agent = server.start_agent("a1", "--allow-commands")
        with server.client() as c:
            wait_for(lambda: c.get("/api/agents").json(), 60, "the agent to register")
            filler = fill(work)
            r = c.post("/api/jobs/command", json={"command": ["python", "ran.py"], "cwd": str(proj)})
            jid = r.json()["id"]
            log = server.data_dir.parent / "agent-a1.log"
            wait_for(lambda: "no claims until space returns" in log.read_text(), 60, "the agent to say why")
            # several claim rounds (one a second) with the disk full, seen as three more heartbeats
            # (each a second) from the live agent: none is made
            three_heartbeats(c)
            j = job(c, jid)
            # before: claimed and run. (A claim asked for just before the disk filled is handed back.)
            assert j["state"] == "queued" and all(a["reason"].endswith("requeued") for a in j["attempts"]), j
            assert not (proj / "ran").exists()
            filler.unlink()
            done = server.wait_job(jid, timeout=60)
            assert done["state"] == "completed" and len(done["attempts"]) == len(j["attempts"]) + 1, done
            assert (proj / "ran").read_text() == "yes"
            assert agent.poll() is None


def test_a_claim_that_arrives_after_the_disk_filled_is_handed_back_before_anything_runs(tmp_path):
    """The agent asked for a job while its disk had room and the answer came after it filled: the job
    goes back to the queue (no retry spent) and nothing of it runs, a command job with a cwd of its
    own (which writes nothing to the work dir before it runs) included. A real agent's job runner on a
    real full disk; no server is needed for it."""
    import asyncio
    import sys

    from tokenpulse.protocol import Claim, CommandSpec
    from worker.agent.agent import Agent

    proj = tmp_path / "proj"
    proj.mkdir()
    spec = CommandSpec(command=[sys.executable, "-c", "open('ran', 'w').write('yes')"], cwd=str(proj),
                       instrument=False)
    with small_fs(tmp_path / "agent", "16m") as work:
        agent = Agent("http://127.0.0.1:9", "unused", work, allow_commands=True, warm_start=False)
        fill(work)
        asyncio.run(agent.runs.start_job(Claim(job_id=3, attempt=1, seq_start=0, kind="command", spec=spec)))
        (state,) = [e for e in agent.outbox.pending[3] if e["kind"] == "state"]
        assert state["data"]["state"] == "queued" and state["data"]["reason"].endswith("requeued"), state
        assert "no space left" in state["data"]["reason"], state
        assert 3 not in agent.jobs and 3 in agent.runs.delivering
        assert not (proj / "ran").exists()
