"""Ingest over the real agent protocol: counts exact under concurrent ingest (nothing lost), nothing
doubled on replay, a re-logged step overwrites (rollup included), bad batches refused whole."""
from __future__ import annotations

import threading

import httpx
import pytest

KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")


def start_job(server, name: str) -> tuple[httpx.Client, int, int]:
    """An agent (agent token) holding one running job: register, submit (user token), claim."""
    agent = httpx.Client(base_url=server.url, timeout=60,
                         headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": name, "host": "h"}).json()["id"]
    with server.client() as user:
        assert user.post("/api/jobs", json={"name": name}).json()["id"]
    # claim until we get ours (other threads may claim concurrently; each agent has capacity 1)
    r = agent.post(f"/api/agents/{aid}/claim")
    assert r.status_code == 200, r.text
    return agent, aid, r.json()["job_id"]


def metric(jid: int, seq: int, step: int, scale: float = 1.0) -> dict:
    return {"kind": "metrics", "job_id": jid, "seq": seq, "t": 1.7e9 + step,
            "data": {"step": step, "values": {k: scale * (i + 1) / (step + 1) for i, k in enumerate(KEYS)}}}


def counts(server, jid: int) -> dict:
    with server.client() as c:
        series = c.get(f"/api/jobs/{jid}/metrics", params={"max_points": 1_000_000}).json()["series"]
    return {k: len(v["step"]) for k, v in series.items()}


def test_concurrent_ingest_counts_exact_and_replays_not_doubled(server):
    steps, batch = 3000, 500  # 2,500 points a batch: stored in two committed chunks
    jobs = [start_job(server, f"a{i}") for i in range(4)]
    errors: list = []

    def run(agent, aid, jid):
        try:
            for b in range(0, steps, batch):
                evs = [metric(jid, s, s) for s in range(b, b + batch)]
                r = agent.post(f"/api/agents/{aid}/events", json={"events": evs})
                assert r.status_code == 200, r.text
                assert r.json()["acked"] == {str(jid): b + batch - 1}
                if b % 1000 == 0:  # a lost reply: the agent sends the same batch again
                    again = agent.post(f"/api/agents/{aid}/events", json={"events": evs})
                    assert again.json()["acked"] == {str(jid): b + batch - 1}
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for agent, aid, jid in jobs:
        assert counts(server, jid) == {k: steps for k in KEYS}
        # An old batch replayed much later (agent restarted from its journal): acknowledged, not stored.
        r = agent.post(f"/api/agents/{aid}/events", json={"events": [metric(jid, s, s, 9.0) for s in range(10)]})
        assert r.json()["acked"] == {str(jid): steps - 1}
        assert counts(server, jid) == {k: steps for k in KEYS}
        with server.client() as c:
            loss = c.get(f"/api/jobs/{jid}/metrics", params={"keys": "loss", "max_points": 10}).json()
        assert loss["series"]["loss"]["total_points"] == steps  # the rollups count each point once
        agent.close()


def test_relogged_step_overwrites_point_and_rollup(server):
    agent, aid, jid = start_job(server, "a")
    evs = [metric(jid, s, s) for s in range(2000)]
    assert agent.post(f"/api/agents/{aid}/events", json={"events": evs}).status_code == 200
    # A resumed job logs steps 1000..1099 again (new seqs): the newest value of a step wins.
    evs = [metric(jid, 2000 + i, 1000 + i, scale=-50.0) for i in range(100)]
    assert agent.post(f"/api/agents/{aid}/events", json={"events": evs}).status_code == 200
    with server.client() as c:
        full = c.get(f"/api/jobs/{jid}/metrics", params={"keys": "loss", "max_points": 100_000}).json()
        small = c.get(f"/api/jobs/{jid}/metrics", params={"keys": "loss", "max_points": 16}).json()
    s = full["series"]["loss"]
    assert len(s["step"]) == 2000 and min(s["value"]) == pytest.approx(-50.0 / 1001)
    d = small["series"]["loss"]
    assert d["downsampled"] and d["total_points"] == 2000
    assert min(d["value"]) == pytest.approx(-50.0 / 1001)  # the new minimum, from the recomputed rollup
    assert max(d["value"]) == pytest.approx(1.0)


def test_bad_batch_refused_whole_and_mixed_kinds_stored(server):
    agent, aid, jid = start_job(server, "a")
    bad = [metric(jid, 0, 0), {"kind": "metrics", "job_id": jid, "seq": 1, "t": 1.0,
                               "data": {"step": -1, "values": {"loss": 1.0}}}]
    r = agent.post(f"/api/agents/{aid}/events", json={"events": bad})
    assert r.status_code == 422 and "events.1" in r.text
    assert agent.post(f"/api/agents/{aid}/events", content=b"{not json").status_code == 422
    for bad in ({"job_id": 2 ** 63}, {"seq": 2 ** 64}, {"data": {"step": 2 ** 63, "values": {"a": 1.0}}}):
        r = agent.post(f"/api/agents/{aid}/events", json={"events": [{**metric(jid, 0, 0), **bad}]})
        assert r.status_code == 422, (bad, r.text)
    r = agent.post(f"/api/agents/{aid}/events", content=b'{"events": [{"kind": "log", "job_id": %d, '
                   b'"seq": 0, "t": NaN, "data": {"line": "x"}}]}' % jid, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert counts(server, jid) == {}
    evs = [{"kind": "phase", "job_id": jid, "seq": 0, "t": 1.0, "data": {"name": "training", "done": 0, "total": 9}},
           metric(jid, 1, 0),
           {"kind": "metrics", "job_id": jid, "seq": 2, "t": 2.0,
            "data": {"step": 1, "values": {"loss": 2, "lr": 1e-4}}},
           {"kind": "log", "job_id": jid, "seq": 3, "t": 3.0, "data": {"line": "hello"}}]
    r = agent.post(f"/api/agents/{aid}/events", json={"events": evs})
    assert r.status_code == 200, r.text
    # A NaN literal (JSON has none; the stdlib reads it) is stored and read back as non-finite.
    nan_body = ('{"events": [{"kind": "metrics", "job_id": %d, "seq": 4, "t": 4.0, '
                '"data": {"step": 2, "values": {"loss": NaN, "lr": 0.5}}}]}' % jid)
    r = agent.post(f"/api/agents/{aid}/events", content=nan_body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    with server.client() as c:
        m = c.get(f"/api/jobs/{jid}/metrics").json()["series"]
        job = c.get(f"/api/jobs/{jid}").json()
        logs = c.get(f"/api/jobs/{jid}/events", params={"kinds": "log"}).json()["events"]
    assert m["loss"]["step"] == [0, 1, 2] and m["loss"]["value"][1:] == [2.0, None]
    assert m["loss"]["nonfinite"] == {"2": "nan"}
    assert m["lr"]["step"] == [0, 1, 2]
    assert job["state"] == "running" and job["step"] == 2 and job["last"]["lr"] == 0.5 and job["last"]["loss"] == "nan"
    assert [e["data"]["line"] for e in logs if e["data"]["line"] == "hello"] == ["hello"]
