"""Two real server processes on one PostgreSQL: live frames reach a browser on either, whichever
process stored the event (LISTEN/NOTIFY, big frames in parts); exactly one process runs the reaper,
and another takes over when it stops."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests import pg
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(pg.bin_dir() is None, reason="PostgreSQL is not installed (make setup installs it)")


def agent_client(srv) -> httpx.Client:
    return httpx.Client(base_url=srv.url, timeout=60, headers={"Authorization": f"Bearer {srv.agent_token}"})


def reaper_of(srv) -> bool:
    return httpx.get(f"{srv.url}/api/health", timeout=10).json()["reaper"]


class Listener:
    """A websocket client reading every frame on a thread."""

    def __init__(self, srv, topics: str):
        self.frames: list[dict] = []
        self.ws = srv.ws(topics)
        self.subscribed = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self.ws.send(json.dumps({"subscribe": topics.split(",")}))  # answered once the hub has us
        assert self.subscribed.wait(30), "the subscription was never confirmed"

    def _read(self):
        try:
            for msg in self.ws:
                f = json.loads(msg)
                if f["type"] == "subscribed":
                    self.subscribed.set()
                self.frames.append(f)
        except Exception:  # closed at the end of the test
            pass

    def events(self, job_id: int) -> dict[int, dict]:
        return {e["seq"]: e for f in list(self.frames) if f["type"] == "events" and f["job_id"] == job_id
                for e in f["events"]}


def test_frames_cross_server_processes_and_one_reaper_acts(server_factory):
    url = pg.cluster().create_database("multi")
    fast = {"database_url": url, "agent_lost_after_s": 3, "reaper_every_s": 0.3}
    a, b = server_factory(**fast), server_factory(**fast)
    # one reaper between them, whichever won the lock
    wait_for(lambda: [reaper_of(a), reaper_of(b)].count(True) == 1, 30, "exactly one reaper",
             show=lambda: (reaper_of(a), reaper_of(b)))

    with a.client() as c:  # submitted on A ...
        jid = c.post("/api/jobs", json={"name": "crossing"}).json()["id"]
    live = Listener(a, f"jobs,alerts,job:{jid}")  # ... watched on A ...
    agent = agent_client(b)  # ... run by an agent that talks to B only
    aid = agent.post("/api/agents", json={"name": "on-b", "host": "h"}).json()["id"]
    # B learns A's topics from A's announcement (at once on a change); until then B builds no
    # frames for them, so the agent's events start once B would relay them.
    time.sleep(0.5)
    assert agent.post(f"/api/agents/{aid}/claim").json()["job_id"] == jid
    big = "é" * 3000  # 6,000 bytes a line: a frame of several lines is over NOTIFY's 8,000 bytes
    evs = [{"kind": "phase", "job_id": jid, "seq": 0, "t": time.time(),
            "data": {"name": "training", "done": 0, "total": 10, "unit": "steps"}}]
    evs += [{"kind": "metrics", "job_id": jid, "seq": 1 + i, "t": time.time(),
             "data": {"step": i, "values": {"loss": 2.0 - i / 10}}} for i in range(5)]
    evs += [{"kind": "log", "job_id": jid, "seq": 6 + i, "t": time.time(), "data": {"line": f"{i}{big}"}}
            for i in range(4)]
    assert agent.post(f"/api/agents/{aid}/events", json={"events": evs}).json()["acked"] == {str(jid): 9}
    # the agent's machine summary, posted to B, is on A's workers page too
    sample = {"cpu_pct": 42.0, "cores": 2, "mem_used_mb": 1000.0, "mem_total_mb": 4000.0, "t": time.time()}
    assert agent.post(f"/api/agents/{aid}/system", json=sample).status_code == 204
    with a.client() as c:
        seen = next(x for x in c.get("/api/agents").json() if x["id"] == aid)["system"]
    assert seen is not None and seen["cpu_pct"] == 42.0 and seen["cores"] == 2, seen
    got = wait_for(lambda: len(live.events(jid)) == 10 and live.events(jid), 30,
                   "A's browser to see every event B stored", show=lambda: sorted(live.events(jid)))
    assert [got[6 + i]["data"]["line"] for i in range(4)] == [f"{i}{big}" for i in range(4)]  # put back whole
    assert got[3]["data"]["values"]["loss"] == pytest.approx(1.8)
    wait_for(lambda: any(f["type"] == "job" and f["job"]["id"] == jid and f["job"]["state"] == "running"
                         for f in live.frames), 30, "A's browser to see the job running (B's summary frame)")

    # The agent goes silent: one reaper marks it lost, once, and A's browser hears the alert.
    wait_for(lambda: any(f["type"] == "alert" and f["alert"]["kind"] == "worker_lost" for f in live.frames),
             60, "the worker_lost alert on A's websocket")
    with a.client() as c:
        alerts = [x for x in c.get("/api/alerts").json() if x["job_id"] == jid and x["kind"] == "worker_lost"]
        job = c.get(f"/api/jobs/{jid}").json()
    assert len(alerts) == 1, alerts
    assert [x["outcome"] for x in job["attempts"]] == ["retried"], job["attempts"]  # handled once

    # The reaper's process stops: the other one takes the lock and reaps the next silent agent.
    leader, other = (a, b) if reaper_of(a) else (b, a)
    leader.kill(signal.SIGTERM)
    wait_for(lambda: reaper_of(other), 30, "the surviving process to take over the reaper")
    ag2 = agent_client(other)
    aid2 = ag2.post("/api/agents", json={"name": "second", "host": "h"}).json()["id"]
    with other.client() as c:
        wait_for(lambda: next(x for x in c.get("/api/agents").json() if x["id"] == aid2)["state"] == "lost",
                 60, "the new reaper to mark a silent agent lost")
