"""The agent's websocket (`/api/agents/{id}/ws`): heartbeats and event batches as messages with the
HTTP routes' answers, a person's request pushed as a nudge, refusals as on HTTP; a real agent
process uses it for a whole job."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

QUICK = {"max_steps": 4, "batch_size": 2, "grad_accum": 1, "max_seq_length": 64, "precision": "fp32"}


def agent_socket(srv, aid: int, token: str | None = None):
    from websockets.sync.client import connect
    return connect(f"ws://127.0.0.1:{srv.port}/api/agents/{aid}/ws",
                   additional_headers={"Authorization": f"Bearer {token or srv.agent_token}"})


def ask(ws, mid: int, **msg) -> dict:
    """Send one request; skip pushed nudges until its answer."""
    ws.send(json.dumps({"id": mid, **msg}))
    while True:
        reply = json.loads(ws.recv(timeout=30))
        if reply.get("id") == mid:
            return reply


def socket_messages(srv) -> float:
    with srv.client() as c:
        text = c.get("/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("tokenpulse_agent_socket_messages_total")))


def test_heartbeats_events_and_pushed_commands_over_the_socket(server):
    agent = httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "sock", "host": "h"}).json()["id"]
    with server.client() as c:
        jid = c.post("/api/jobs", json={"name": "over-ws"}).json()["id"]
    assert agent.post(f"/api/agents/{aid}/claim").json()["job_id"] == jid
    with agent_socket(server, aid) as ws:
        now = time.time()
        assert ask(ws, 1, heartbeat={str(jid): now}) == {"id": 1, "commands": []}
        evs = [{"kind": "phase", "job_id": jid, "seq": 0, "t": now,
                "data": {"name": "training", "done": 0, "total": 8, "unit": "steps"}},
               {"kind": "metrics", "job_id": jid, "seq": 1, "t": now, "data": {"step": 1, "values": {"loss": 2.5}}}]
        assert ask(ws, 2, events=evs)["acked"] == {str(jid): 1}
        assert ask(ws, 3, events=evs)["acked"] == {str(jid): 1}  # a replay: acknowledged, stored once
        bad = ask(ws, 4, events=[{"kind": "metrics", "job_id": jid, "seq": 2, "t": now, "data": {"step": -1}}])
        assert bad["status"] == 422, bad  # what HTTP answers; the agent then splits it over HTTP
        with server.client() as c:
            job = c.get(f"/api/jobs/{jid}").json()
            assert job["state"] == "running" and job["alive_at"] == pytest.approx(now)
            assert c.get(f"/api/jobs/{jid}/metrics").json()["series"]["loss"]["value"] == [2.5]
            # A person's cancel reaches the connected agent at once: a nudge, then the command.
            c.post(f"/api/jobs/{jid}/cancel").raise_for_status()
        assert json.loads(ws.recv(timeout=30)) == {"nudge": True}
        cmds = ask(ws, 5, heartbeat={str(jid): time.time()})["commands"]
        assert {"job_id": jid, "action": "cancel"} in cmds, cmds
    assert socket_messages(server) == 5


def test_socket_refuses_what_http_refuses(server):
    agent = httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "mine", "host": "h"}).json()["id"]
    from websockets.exceptions import InvalidStatus
    with pytest.raises(InvalidStatus):  # a user token is not an agent's
        agent_socket(server, aid, token=server.token).recv(timeout=10)
    with pytest.raises(InvalidStatus):  # an agent that does not exist
        agent_socket(server, aid + 100).recv(timeout=10)
    with server.client() as c:
        other = c.post("/api/tokens", json={"name": "other", "role": "agent"}).json()
    with pytest.raises(InvalidStatus):  # another token's agent
        agent_socket(server, aid, token=other["token"]).recv(timeout=10)
    with agent_socket(server, aid) as ws:
        assert ask(ws, 1, heartbeat={}) == {"id": 1, "commands": []}
        assert ask(ws, 2, nothing=1)["status"] == 422


def test_real_agent_runs_a_job_over_its_socket(agent_server):
    with agent_server.client() as c:
        jid = c.post("/api/jobs", json={"name": "real", **QUICK}).json()["id"]
    job = agent_server.wait_job(jid, timeout=300)
    assert job["state"] == "completed", job
    assert socket_messages(agent_server) > 3  # its heartbeats and batches came over the socket
    with agent_server.client() as c:
        assert c.get(f"/api/jobs/{jid}/metrics").json()["series"]["loss"]["step"][-1] == 4


def test_idle_real_agent_claims_when_the_server_says_a_job_waits(server, tmp_path):
    """The real agent, idle on its socket, does not claim every poll_s (100 idle agents polling cost
    the server a third of a core: bench/idle_agents.py): after an empty claim it waits for the
    server's "work" push, and a submitted job is claimed at once."""
    from worker.agent.agent import Agent
    poll_s = 0.5

    async def scenario() -> tuple[int, float, int]:
        agent = Agent(server.url, server.agent_token, tmp_path / "work", name="idle", poll_s=poll_s,
                      heartbeat_s=1.0)
        claims: list[float] = []  # monotonic times of its claim requests

        async def count(request: httpx.Request) -> None:
            if request.url.path.endswith("/claim"):
                claims.append(time.monotonic())
        agent.link.http.event_hooks["request"].append(count)
        run = asyncio.create_task(agent.run(max_jobs=1))  # ends once its one job is done
        deadline = time.monotonic() + 60
        while agent.link.channel.ws is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert agent.link.channel.ws is not None, "the agent's socket never connected"
        await asyncio.sleep(4 * poll_s)  # a claim sent before the socket was up has been answered
        before = len(claims)
        await asyncio.sleep(8 * poll_s)
        idle_claims = len(claims) - before  # polling: ~8
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}) as c:
            submitted = time.monotonic()
            jid = (await c.post("/api/jobs", json={"name": "pushed", **QUICK})).json()["id"]
        await asyncio.wait_for(run, 300)
        return idle_claims, min(t for t in claims if t >= submitted) - submitted, jid

    idle_claims, claimed_after, jid = asyncio.run(scenario())
    assert idle_claims <= 1, f"{idle_claims} claims in {8 * poll_s:.0f} s idle on the socket"
    assert claimed_after < 5, f"claimed {claimed_after:.1f} s after the submit"  # the push, not the 30 s claim
    with server.client() as c:
        assert c.get(f"/api/jobs/{jid}").json()["state"] == "completed"


def test_socket_heartbeat_carries_rank_rows_and_says_when_work_waits(server):
    """One message model on both transports: a Heartbeat with a distributed job's rank rows goes over
    the socket as over HTTP; a submitted job is pushed to idle agents ("work"), and a heartbeat's
    answer says "work" while any job waits."""
    agent = httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "ranks", "host": "h"}).json()["id"]
    with agent_socket(server, aid) as ws:
        assert ask(ws, 1, heartbeat={"jobs": {}}) == {"id": 1, "commands": []}  # no job waits: no "work"
        with server.client() as c:
            jid = c.post("/api/jobs", json={"name": "ddp", **QUICK}).json()["id"]
        assert json.loads(ws.recv(timeout=30)) == {"work": True}  # pushed: an idle agent claims now
        assert ask(ws, 2, heartbeat={})["work"] is True  # and said in answers while it waits
        assert agent.post(f"/api/agents/{aid}/claim").json()["job_id"] == jid
        now = time.time()
        rows = [{"rank": 0, "host": "h", "pid": 100, "step": 3, "step_time_s": 0.4},
                {"rank": 1, "host": "h", "pid": 101, "step": 3, "step_time_s": 0.5}]
        reply = ask(ws, 3, heartbeat={"jobs": {str(jid): now}, "ranks": {str(jid): rows}})
        assert reply == {"id": 3, "commands": []}, reply
        bad = ask(ws, 4, heartbeat={"jobs": {str(jid): now}, "ranks": {str(jid): [{"rank": -1}]}})
        assert bad["status"] == 422 and "rank" in bad["detail"], bad  # checked by the model, as on HTTP
    with server.client() as c:
        got = c.get(f"/api/jobs/{jid}/ranks").json()
        assert [(r["rank"], r["pid"], r["step"]) for r in got] == [(0, 100, 3), (1, 101, 3)], got
        assert c.get(f"/api/jobs/{jid}").json()["alive_at"] == pytest.approx(now)


def test_agent_message_model():
    from pydantic import ValidationError

    from tokenpulse.protocol import AgentMessage
    m = AgentMessage.model_validate({"id": 1, "heartbeat": {"3": 5.0}})  # the first dialect: jobs alone
    assert m.heartbeat.jobs == {3: 5.0} and m.heartbeat.ranks == {} and m.events is None
    m = AgentMessage.model_validate({"id": 2, "heartbeat": {"jobs": {"3": 5.0}, "ranks": {"3": [{"rank": 0}]}},
                                     "events": []})
    assert m.heartbeat.ranks[3][0].rank == 0 and m.events == []
    for bad in [{"id": 3}, {"id": 4, "heartbeat": ["x"]}, {"id": 5, "events": {}},
                {"id": 6, "heartbeat": {"x": 1.0}}, {"heartbeat": {}}]:
        with pytest.raises(ValidationError):
            AgentMessage.model_validate(bad)
