"""Security on a real server process: path confinement, the remote-code gate, no test knobs in the API,
body size limits, websocket frame validation, token roles/revocation (stored hashed), CORS closed,
HttpOnly/SameSite cookies and CSRF. Each refusal says why, and nothing is stored."""
from __future__ import annotations

import hashlib
import json
import re
import time

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect


def count(srv, table: str) -> int:
    return srv.query(f"SELECT count(*) FROM {table}")[0][0]


def refused(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    text = r.text.lower()
    for w in words:
        assert w.lower() in text, (w, r.text)


def test_paths_confined_to_roots_and_code_gates(server_factory, tmp_path):
    root, outside = tmp_path / "roots", tmp_path / "outside"
    (root / "model").mkdir(parents=True)
    (root / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "remote").mkdir()
    (root / "remote" / "config.json").write_text(json.dumps({"auto_map": {"AutoModelForCausalLM": "m.Model"}}))
    (root / "data.jsonl").write_text('{"text": "hello"}\n')
    (outside / "model").mkdir(parents=True)
    (outside / "model" / "config.json").write_text("{}")
    (outside / "data.jsonl").write_text('{"text": "secret"}\n')
    (root / "link").symlink_to(outside)
    srv = server_factory(path_roots=[str(root)])
    with srv.client() as c:
        attempts = [
            ({"dataset": f"{root}/../outside/data.jsonl"}, "dataset"),  # ../ escape
            ({"dataset": f"{root}/link/data.jsonl"}, "dataset"),  # symlink inside the root, pointing out
            ({"model": f"{root}/../outside/model"}, "model"),
            ({"model": f"{root}/link/model"}, "model"),
            ({"dataset": "/etc/passwd"}, "dataset"),
        ]
        for body, field in attempts:
            r = c.post("/api/jobs", json=body)
            refused(r, 422, "outside the allowed roots")
            assert r.json()["detail"]["field"] == field
        refused(c.post("/api/jobs", json={"model": str(root / "remote")}), 422, "trust_remote_code")
        refused(c.post("/api/datasets/analyze", json={"dataset": f"{root}/link/data.jsonl"}), 422, "outside")
        assert count(srv, "jobs") == 0  # nothing stored
        ok = c.post("/api/jobs", json={"dataset": str(root / "data.jsonl"), "model": str(root / "model")})
        assert ok.status_code == 201, ok.text  # inside the roots: accepted


def test_api_carries_no_fault_injection_knob(server):
    """Fault injection is test-only (worker/training/faults.py, TOKENPULSE_FAULT_PLAN): a spec with
    `fault` is refused as an unknown field, and the OpenAPI schema names no fault anywhere."""
    with server.client() as c:
        r = c.post("/api/jobs", json={"name": "x", "fault": {"crash_at_step": 1}})
        refused(r, 422, "fault")
        assert "not a setting" in r.text.lower(), r.text  # an unknown field, in plain words (issue 25 #10)
        assert count(server, "jobs") == 0
        schema = c.get("/openapi.json")
        assert schema.status_code == 200
        assert not re.search(r"\bfault", schema.text, re.I), re.findall(r".{80}\bfault.{40}", schema.text, re.I)
        assert "JobSpec" in schema.json()["components"]["schemas"]  # the check can fail: the spec is there


def test_oversized_bodies_refused_before_anything_is_stored(server_factory):
    limit = 64 * 1024
    srv = server_factory(max_body_bytes=limit)
    big = json.dumps({"name": "x", "padding": "y" * (2 * limit)}).encode()
    with srv.client() as c:
        refused(c.post("/api/jobs", content=big, headers={"content-type": "application/json"}),
                413, f"limit of {limit} bytes")

        def chunks():  # no Content-Length: the limit holds while reading
            for _ in range(16):
                yield b" " * (limit // 4)
        refused(c.post("/api/jobs", content=chunks(), headers={"content-type": "application/json"}), 413, "limit")
        agent = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {srv.agent_token}"})
        aid = agent.post("/api/agents", json={"name": "a", "host": "h"}).json()["id"]
        events = [{"kind": "log", "job_id": 1, "seq": i, "t": 0, "data": {"line": "z" * 1000}} for i in range(200)]
        refused(agent.post(f"/api/agents/{aid}/events", json={"events": events}), 413, "limit")
        # a malformed but small body is a 422 naming the field, not a 500
        refused(c.post("/api/jobs", json={"max_steps": "many"}), 422, "max_steps")
        assert count(srv, "jobs") == 0 and count(srv, "events") == 0


def test_websocket_messages_validated_like_rest(server_factory):
    srv = server_factory()
    with srv.ws("jobs") as ws:
        for bad, words in [("not json", "json"), (json.dumps({"subscribe": ["job:0"]}), "unknown topic"),
                           (json.dumps({"subscribe": "jobs"}), "subscribe"), (json.dumps({"sub": ["jobs"]}), "sub"),
                           (json.dumps([1, 2]), ""), (b"\x00\xffbinary", "binary")]:
            ws.send(bad)
            reply = json.loads(ws.recv(timeout=10))
            assert reply["type"] == "error" and all(w in reply["message"].lower() for w in words.split()), (bad, reply)
        ws.send(json.dumps({"subscribe": ["alerts"]}))  # still open and working after all that
        assert json.loads(ws.recv(timeout=10)) == {"type": "subscribed", "topics": ["alerts", "jobs"]}
    with pytest.raises(InvalidStatus):  # no token
        connect(f"ws://127.0.0.1:{srv.port}/ws?topics=jobs").recv(timeout=5)
    with pytest.raises(InvalidStatus):  # an agent token cannot watch
        srv.ws("jobs", token=srv.agent_token).recv(timeout=5)
    cookie = {"Cookie": f"tokenpulse_session={session_secret(srv)}"}
    with pytest.raises(InvalidStatus):  # another site's page riding on the cookie (no CORS for websockets)
        connect(f"ws://127.0.0.1:{srv.port}/ws?topics=jobs", additional_headers=cookie,
                origin="http://evil.example").recv(timeout=5)
    with connect(f"ws://127.0.0.1:{srv.port}/ws?topics=jobs", additional_headers=cookie,
                 origin=f"http://127.0.0.1:{srv.port}") as ws:  # our own page: fine
        ws.send(json.dumps({"subscribe": ["alerts"]}))
        assert json.loads(ws.recv(timeout=10))["type"] == "subscribed"


def test_tokens_roles_revocation_cors_and_csrf(server_factory):
    srv = server_factory()
    url = srv.url
    with srv.client() as c:
        made = c.post("/api/tokens", json={"name": "ci agent", "role": "agent"}).json()
        second_agent = made["token"]
        user2 = c.post("/api/tokens", json={"name": "bob", "role": "user"}).json()
        listed = c.get("/api/tokens").json()
        assert all("token" not in t and "hash" not in t for t in listed) and len(listed) == 4
    if srv.on_postgres:  # every stored row of every table that could hold it, as text
        raw = "".join(repr(srv.query(f"SELECT * FROM {t}")) for t in ("tokens", "sessions", "agents")).encode()
    else:
        raw = b"".join(p.read_bytes() for p in srv.data_dir.glob("tokenpulse.db*"))  # the file and its WAL
    assert second_agent.encode() not in raw and hashlib.sha256(second_agent.encode()).hexdigest().encode() in raw

    agent = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {srv.agent_token}"})
    other = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {second_agent}"})
    user = srv.client()
    # roles: an agent token only claims and reports; a user token cannot pose as an agent
    refused(agent.get("/api/jobs"), 403, "agent token")
    refused(agent.post("/api/jobs", json={}), 403, "agent token")
    refused(agent.post("/api/tokens", json={"name": "x", "role": "user"}), 403, "agent token")
    refused(user.post("/api/agents", json={"name": "a", "host": "h"}), 403, "agent token")
    mine = agent.post("/api/agents", json={"name": "a", "host": "h"}).json()["id"]
    theirs = other.post("/api/agents", json={"name": "b", "host": "h"}).json()["id"]
    refused(agent.post(f"/api/agents/{theirs}/claim"), 403, "another token")
    jid = user.post("/api/jobs", json={"max_steps": 3}).json()["id"]
    claim = other.post(f"/api/agents/{theirs}/claim").json()
    assert claim["job_id"] == jid
    # revoked: refused at once with a clear error, and what it sends is not stored
    assert user.post(f"/api/tokens/{made['id']}/revoke").json()["revoked_at"]
    ev = {"kind": "metrics", "job_id": jid, "seq": claim["seq_start"], "t": time.time(),
          "data": {"step": 1, "values": {"loss": 1.0}}}
    refused(other.post(f"/api/agents/{theirs}/events", json={"events": [ev]}), 401, "invalid token")
    refused(other.post(f"/api/agents/{theirs}/claim"), 401, "invalid token")
    assert count(srv, "metrics") == 0
    assert agent.post(f"/api/agents/{mine}/heartbeat", json={"jobs": {}}).status_code == 200  # others unaffected
    user.post(f"/api/tokens/{user2['id']}/revoke").raise_for_status()
    refused(httpx.get(f"{url}/api/jobs", headers={"Authorization": f"Bearer {user2['token']}"}), 401, "invalid token")

    # CORS closed: no preflight is granted, no response carries Access-Control-Allow-Origin
    pre = httpx.options(f"{url}/api/jobs", headers={"Origin": "http://evil.example",
                                                    "Access-Control-Request-Method": "POST"})
    assert pre.status_code >= 400 and "access-control-allow-origin" not in pre.headers
    assert "access-control-allow-origin" not in user.get("/api/jobs", headers={"Origin": "http://evil.example"}).headers

    # the session cookie: HttpOnly, SameSite=Strict; state changes by cookie need the CSRF header
    login = httpx.post(f"{url}/login", data={"token": srv.token, "next": "/"})
    assert login.status_code == 303
    set_cookie = login.headers["set-cookie"].lower()
    assert "httponly" in set_cookie and "samesite=strict" in set_cookie
    browser = httpx.Client(base_url=url, cookies={"tokenpulse_session": login.cookies["tokenpulse_session"]})
    assert browser.get("/api/jobs").status_code == 200
    before = count(srv, "jobs")
    refused(browser.post("/api/jobs", json={}), 403, "x-tokenpulse-csrf")
    refused(browser.post("/api/jobs", json={}, headers={"Authorization": "Basic eDp5"}), 403, "x-tokenpulse-csrf")
    refused(browser.post(f"/api/jobs/{jid}/cancel"), 403, "x-tokenpulse-csrf")
    assert count(srv, "jobs") == before
    ok = browser.post("/api/jobs", json={}, headers={"X-Tokenpulse-Csrf": "1", "Origin": url})
    assert ok.status_code == 201, ok.text


def session_secret(srv) -> str:
    """Log in through the form, as a browser does: the cookie's value."""
    r = httpx.post(f"{srv.url}/login", data={"token": srv.token, "next": "/"})
    assert r.status_code == 303, r.text
    return r.cookies["tokenpulse_session"]


class _Evil:
    def __reduce__(self):  # what a crafted "checkpoint" runs when unpickled
        import os
        return os.system, (f"touch {_Evil.marker}",)


def test_agent_refuses_checkpoints_outside_its_resume_roots(server_factory, tmp_path):
    """A checkpoint path comes from whichever agent reported it, and loading one runs a pickle: an
    agent token must not be able to point another agent at a crafted file."""
    import pickle
    evil = tmp_path / "evil" / "step-0000001"
    (evil / "model").mkdir(parents=True)
    (evil / "meta.json").write_text(json.dumps({"step": 1, "complete": True}))
    _Evil.marker = tmp_path / "pwned"
    (evil / "trainer_state.pt").write_bytes(pickle.dumps(_Evil()))
    srv = server_factory()
    bot = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {srv.agent_token}"})
    with srv.client() as c:
        jid = c.post("/api/jobs", json={"max_steps": 2, "batch_size": 2, "grad_accum": 1, "max_seq_length": 64,
                                        "precision": "fp32", "device": "cpu"}).json()["id"]
        aid = bot.post("/api/agents", json={"name": "rogue", "host": "h"}).json()["id"]
        claim = bot.post(f"/api/agents/{aid}/claim").json()
        seq, now = claim["seq_start"], time.time()
        bot.post(f"/api/agents/{aid}/events", json={"events": [
            {"kind": "checkpoint", "job_id": jid, "seq": seq, "t": now, "data": {"step": 1, "path": str(evil)}},
            {"kind": "state", "job_id": jid, "seq": seq + 1, "t": now,
             "data": {"state": "failed", "failure": "crash", "reason": "boom", "retry": True}}]}).raise_for_status()
        assert c.get(f"/api/jobs/{jid}").json()["checkpoint"] == str(evil)
        srv.start_agent("a1")
        j = srv.wait_job(jid, states=("completed", "failed"), timeout=120)
        logs = c.get(f"/api/jobs/{jid}/events", params={"kinds": ["log"]}).json()["events"]
    assert j["state"] == "completed", j
    assert not _Evil.marker.exists()  # the crafted pickle was never loaded
    assert any("outside this agent's resume roots" in e["data"]["line"] for e in logs)
