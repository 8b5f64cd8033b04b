"""Bad input gets a 4xx that names the field, and nothing is stored; no token, no access."""
from __future__ import annotations

import json

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

BAD_SPECS = [
    ({"learning_rate": -1}, "learning_rate"),
    ({"max_steps": 0}, "max_steps"),
    ({"padding": "sideways"}, "padding"),
    ({"precision": "fp8"}, "precision"),
    ({"batch_size": 0}, "batch_size"),
    ({"max_seq_length": 3}, "max_seq_length"),
    ({"model": "/no/such/model/dir"}, "model"),
    ({"dataset": "/no/such/data.jsonl"}, "dataset"),
    ({"unknown_setting": 1}, "unknown_setting"),
    ({"prompt_field": "q"}, "body"),  # prompt without response
]


@pytest.mark.parametrize("spec,field", BAD_SPECS)
@pytest.mark.shared_server
def test_bad_spec_is_refused_naming_the_field(server, spec, field):
    with server.client() as c:
        before = c.get("/api/jobs").json()["total"]
        r = c.post("/api/jobs", json=spec)
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        fields = [e["field"] for e in detail["errors"]]
        assert field in fields, detail
        assert detail["message"]
        assert c.get("/api/jobs").json()["total"] == before, "nothing half-written is stored"


def test_dataset_checks_use_the_data(server, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    not_model = tmp_path / "empty_dir"
    not_model.mkdir()
    unreadable = tmp_path / "data.xml"
    unreadable.write_text("<x/>")
    with server.client() as c:
        cases = [
            ({"dataset": str(data), "text_field": "body"}, "text_field", "not in the dataset"),
            ({"dataset": str(data)}, "text_field", "no 'text' column"),
            ({"dataset": str(data), "prompt_field": "question", "response_field": "reply"}, "response_field", "reply"),
            ({"model": str(not_model)}, "model", "config.json"),
            ({"dataset": str(unreadable)}, "dataset", "unsupported"),
        ]
        for spec, field, words in cases:
            r = c.post("/api/jobs", json=spec)
            assert r.status_code == 422, (spec, r.text)
            d = r.json()["detail"]
            assert d["field"] == field and words in d["message"], d
        ok = c.post("/api/jobs", json={"dataset": str(data), "prompt_field": "question", "response_field": "answer"})
        assert ok.status_code == 201, ok.text
        assert c.get("/api/jobs").json()["total"] == 1
        # loss on the response only: unless asked, on for data with a prompt, off for plain text (issue 33 #21)
        alpaca = tmp_path / "alpaca.jsonl"
        alpaca.write_text(json.dumps({"instruction": "add", "input": "2+2", "output": "4"}) + "\n")
        said = {name: c.post("/api/jobs", json=spec).json()["spec"]["loss_on_response_only"] for name, spec in (
            ("pairs", {"dataset": str(data), "prompt_field": "question", "response_field": "answer"}),
            ("alpaca", {"dataset": str(alpaca)}), ("text", {}),
            ("text, asked", {"loss_on_response_only": True}))}
        assert said == {"pairs": True, "alpaca": True, "text": False, "text, asked": True}, said


@pytest.mark.shared_server
def test_without_token_rest_is_401_and_websocket_refused(server):
    r = httpx.get(f"{server.url}/api/jobs")
    assert r.status_code == 401 and "token" in r.json()["detail"]
    r = httpx.post(f"{server.url}/api/jobs", json={}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    with pytest.raises((InvalidStatus, ConnectionClosed)):
        with server.ws("jobs", token="wrong") as ws:
            ws.recv(timeout=5)
    # pages send the browser to the login form
    r = httpx.get(f"{server.url}/", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/login")


@pytest.mark.shared_server
def test_agent_token_cannot_act_as_user_and_user_cannot_claim(server):
    agent = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.agent_token}"})
    assert agent.post("/api/jobs", json={}).status_code == 403
    assert agent.get("/api/jobs").status_code == 403
    with server.client() as user:
        assert user.post("/api/agents", json={"name": "x", "host": "h"}).status_code == 403


@pytest.mark.shared_server
def test_cookie_login_and_csrf(server):
    with httpx.Client(base_url=server.url, follow_redirects=False) as b:
        bad = b.post("/login", data={"token": "nope", "next": "/"})
        assert bad.status_code == 401 and "not valid" in bad.text
        r = b.post("/login", data={"token": server.token, "next": "/"})
        assert r.status_code == 303
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        assert b.get("/").status_code == 200
        assert b.get("/api/jobs").status_code == 200
        # a state change riding only on the cookie needs the CSRF header
        assert b.post("/api/jobs", json={}).status_code == 403
        assert b.post("/api/jobs", json={}, headers={"X-TokenPulse-CSRF": "1"}).status_code == 201


def test_jobs_sorted_and_filtered_by_a_column_across_every_page(server):
    """The jobs list's picked columns (a setting, a latest metric) sort and filter all jobs on the
    server, not the 50 on the page: numbers as numbers, blanks last, nested settings by their dots."""
    agent = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "fake", "host": "h"}).json()["id"]
    lrs = [3e-4, 1e-3, 2e-5, 5e-4]  # 1e-3 > 5e-4 > 3e-4 > 2e-5: not the text order
    ids = []
    with server.client() as c:
        for i, lr in enumerate(lrs):
            jid = c.post("/api/jobs", json={"name": f"col-{i}", "max_steps": 5, "learning_rate": lr,
                                            "stall": {"factor": 10 - i}}).json()["id"]
            assert agent.post(f"/api/agents/{aid}/claim").json()["job_id"] == jid
            batch = [{"kind": "metrics", "job_id": jid, "seq": 0, "t": 1.0e9,
                      "data": {"step": 1, "values": {"eval/loss": 2.0 + i, "loss": 9.0 - i}}},
                     {"kind": "state", "job_id": jid, "seq": 1, "t": 1.0e9 + 1,
                      "data": {"state": "completed", "reason": "trained"}}]  # frees the agent for the next
            agent.post(f"/api/agents/{aid}/events", json={"events": batch}).raise_for_status()
            ids.append(jid)
        blank = c.post("/api/jobs", json={"name": "col-none", "max_steps": 5,
                                          "learning_rate": 0.1}).json()["id"]  # no metrics yet

        def names(**params):
            r = c.get("/api/jobs", params=params)
            assert r.status_code == 200, r.text
            return [j["name"] for j in r.json()["jobs"]]

        assert names(sort="spec:learning_rate", limit=2) == ["col-2", "col-0"]
        assert names(sort="spec:learning_rate", desc=True, limit=2) == ["col-none", "col-1"]
        assert names(sort="spec:learning_rate", desc=True, limit=2, offset=2) == ["col-3", "col-0"]
        assert names(sort="last:eval/loss", limit=5) == ["col-0", "col-1", "col-2", "col-3", "col-none"]
        assert names(sort="last:eval/loss", desc=True, limit=5)[-1] == "col-none", "blanks last either way"
        assert names(sort="spec:stall.factor", limit=1) == ["col-3"]  # a nested setting
        r = c.get("/api/jobs", params={"filter": ["last:loss<8", "spec:name~COL-"], "sort": "last:loss", "limit": 1})
        assert r.json()["total"] == 2 and [j["id"] for j in r.json()["jobs"]] == [ids[3]], r.text
        assert names(filter="last:loss>100") == []
        assert blank not in [j["id"] for j in c.get("/api/jobs", params={"filter": "last:loss>0"}).json()["jobs"]]
        for params, field in (({"sort": "loss"}, "sort"), ({"filter": "last:loss"}, "filter"),
                              ({"filter": "last:loss<abc"}, "filter")):
            r = c.get("/api/jobs", params=params)
            assert r.status_code == 422 and r.json()["detail"]["field"] == field, r.text
