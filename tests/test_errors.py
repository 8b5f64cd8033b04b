"""Every 422 has one shape, whichever check refused the request (pydantic, the spec checks, a clone's
edit, an out-of-range number, the agent batch parser); a refused state change is a 409 naming why.
Against a real server."""
from __future__ import annotations

import httpx

SHAPE = {"message", "field", "errors"}


def assert_422(r: httpx.Response, field) -> dict:
    assert r.status_code == 422, r.text
    d = r.json()["detail"]
    assert set(d) == SHAPE, d
    assert d["field"] == field and d["message"], d
    assert d["errors"] and all(set(e) == {"field", "message"} and e["message"] for e in d["errors"]), d
    return d


def agent_with_job(server) -> tuple[httpx.Client, int, int]:
    agent = httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "a", "host": "h"}).json()["id"]
    with server.client() as c:
        c.post("/api/jobs", json={"name": "x"})
    r = agent.post(f"/api/agents/{aid}/claim")
    assert r.status_code == 200, r.text
    return agent, aid, r.json()["job_id"]


def test_every_422_has_the_same_shape(server, tmp_path):
    with server.client() as c:
        d = assert_422(c.post("/api/jobs", json={"learning_rate": "fast"}), "learning_rate")  # pydantic
        assert d["message"].startswith("learning_rate: ")
        missing = tmp_path / "nope.jsonl"
        d = assert_422(c.post("/api/jobs", json={"dataset": str(missing)}), "dataset")  # server/validate.py
        assert d["errors"] == [{"field": "dataset", "message": d["message"]}]
        job = c.post("/api/jobs", json={"name": "p"}).json()
        assert_422(c.post(f"/api/jobs/{job['id']}/clone", json={"changes": {"max_steps": -5}}), "max_steps")
        assert_422(c.post("/api/datasets/analyze", json={"dataset": str(missing)}), "dataset")
        assert_422(c.get(f"/api/jobs/{2 ** 64}"), None)  # past SQLite's 64 bits: OverflowError
        assert_422(c.get("/api/jobs", params={"limit": 0}), "limit")


def test_a_deeply_nested_event_is_a_422_not_a_500(server):
    agent, aid, jid = agent_with_job(server)
    for depth in (40, 1000, 5000):  # past the parser's limit; past json.dumps' stack; past orjson's
        body = '{"events": [{"kind": "info", "job_id": %d, "seq": 0, "t": 1.0, "data": %s}]}' % (
            jid, "{\"x\": " * depth + "1" + "}" * depth)
        r = agent.post(f"/api/agents/{aid}/events", content=body, headers={"content-type": "application/json"})
        assert_422(r, "events.0" if depth < 1024 else "body")
    ok = {"kind": "info", "job_id": jid, "seq": 0, "t": 1.0, "data": {"a": {"b": {"c": [1, [2, [3]]]}}}}
    r = agent.post(f"/api/agents/{aid}/events", json={"events": [ok]})
    assert r.status_code == 200 and r.json()["acked"] == {str(jid): 0}, r.text
    with server.client() as c:
        assert c.get(f"/api/jobs/{jid}").json()["info"] == {"a": {"b": {"c": [1, [2, [3]]]}}}


def test_a_refused_request_is_a_409_naming_the_state(server):
    with server.client() as c:
        job = c.post("/api/jobs", json={"name": "q"}).json()
        r = c.post(f"/api/jobs/{job['id']}/resume")
        assert r.status_code == 409
        assert r.json()["detail"] == f"job {job['id']} is queued; only a paused job can be resumed"
        assert c.post(f"/api/jobs/{job['id']}/cancel").json()["state"] == "cancelled"
        r = c.post(f"/api/jobs/{job['id']}/cancel")
        assert r.status_code == 409 and "is cancelled; only queued, paused or running jobs" in r.json()["detail"]
        assert c.post(f"/api/jobs/{job['id']}/pause").status_code == 409
        assert c.post(f"/api/jobs/{job['id'] + 1}/pause").status_code == 404
